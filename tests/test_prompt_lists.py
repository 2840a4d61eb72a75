"""The prompt lists as data (draft/train/prompt_lists.json, broad_prompt_lists.json): a seed still gives the
prompts it gave when the lists were Python constants.

The digests and texts below were recorded from the code before the lists moved to JSON (draft/train_eagle.py and
draft/broad_prompts.py at c8651ba), with the same fake target: a reordered, edited, added or dropped entry changes
them. Changing a list on purpose changes the data every seed generates; record new values then.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from draft.train import prompt_lists as pl
from draft.train.broad_prompts import broad_prompts
from draft.train.self_prompts import add_followups, self_prompts

LIST_DIGESTS = {
    "TOPICS": "523abb6ba4f564d9", "META_STYLES": "c0b9828f6934bbed", "SUMMARIZE_PREFIXES": "ddc0e3fe87673b1e",
    "REWRITE_PREFIXES": "afc0c1653a1da5be", "TEMPLATE_STYLES": "4f20bf47f8e5aa9c", "FOLLOWUPS": "8021ff9ad873c55c",
    "CODE_TASKS": "6bc400cb42e9e2a0", "CODE_STYLES": "859d7d37ff84816c", "NAMES": "52692ab6af4d482a",
    "ITEMS": "4fe01b1d68ad8ab0", "MATH_TEMPLATES": "28b42ebe94dabd23", "LANGS": "0c780fc9a0e5e0ac",
    "FOREIGN": "e2ca388da64aa051", "ENTITIES": "8976061412bf3924", "ROLES": "e9744d4d0eaf0517",
    "FOLLOWUP2": "18383423be0bf989",
    # inline lists of the old broad_prompts() (f-strings there, templates now; checked equal when formatted)
    "PASSAGE_STYLES": "45b5805d5a1b9e1c", "TRANSLATE_TO_ENGLISH": "e8dc935a25045667",
    "SUMMARY_PREFIXES": "c1c1ba391a8773ca", "RAG_QUESTIONS": "b47a0ae25973a427", "MULTITURN_OPENERS": "d99652b17ff3ca7e",
}


def digest(x) -> str:
    return hashlib.sha256(json.dumps(x, ensure_ascii=False).encode()).hexdigest()[:16]


class FakeTok:
    """Characters as token ids; 0 = pad and end of turn (``template="raw"`` prompts are the text's characters)."""
    eos_token_id = 0
    pad_token_id = 0
    unk_token_id = -1
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def convert_tokens_to_ids(self, token):
        return -1

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeModel:
    """Answers every (left padded) prompt with a text made from the prompt alone, then token 0: the replies do not
    depend on batching, sampling or a library version."""

    def parameters(self):
        yield torch.zeros(1)

    @staticmethod
    def reply(prompt: str) -> str:
        return (f'Sure: "{prompt[:150]} ok?" {prompt} It is widely said that this holds true for many people '
                f'in many places.')

    def generate(self, input_ids, attention_mask, generation_config):
        rows = []
        for ids, att in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = "".join(chr(t) for t, a in zip(ids, att) if a)
            rows.append([ord(c) for c in self.reply(prompt)] + [0])
        width = max(len(r) for r in rows)
        out = torch.zeros(len(rows), input_ids.shape[1] + width, dtype=torch.long)
        out[:, :input_ids.shape[1]] = input_ids
        for i, r in enumerate(rows):
            out[i, input_ids.shape[1]:input_ids.shape[1] + len(r)] = torch.tensor(r)
        return out


@pytest.mark.parametrize("name", sorted(LIST_DIGESTS))
def test_each_list_is_unchanged(name):
    assert digest(getattr(pl, name)) == LIST_DIGESTS[name], f"{name} differs from the recorded list"


def test_self_prompts_of_a_seed_are_unchanged():
    sp = self_prompts(FakeModel(), FakeTok(), 40, seed=3, batch_size=8, template="raw", progress=False)
    counts = {s: sum(c["source"] == s for c in sp) for s in sorted({c["source"] for c in sp})}
    assert counts == {"self:instruction": 2, "self:message": 1, "self:question": 8, "self:rewrite": 4,
                      "self:summarize": 3, "tmpl:code": 6, "tmpl:math": 4, "tmpl:topic": 12}
    assert sp[:4] == [
        {"turns": ["How do I write a Python function that does this: Multiply two matrices. Show the code and "
                   "explain it."], "source": "tmpl:code"},
        {"turns": ["Alice earns $25 per hour and works 7 hours a week. How much does Alice earn in 6 weeks?"],
         "source": "tmpl:math"},
        {"turns": ["Write a JavaScript function named reverse_words for this task: Return the words of s in reverse "
                   "order."], "source": "tmpl:code"},
        {"turns": ["Alice bakes 200 cookies and packs them into boxes of 3. How many full boxes are there, and how "
                   "many cookies are left over?"], "source": "tmpl:math"}]
    assert digest(sp) == "73ac5ae3c8b673b7"


def test_broad_prompts_of_a_seed_are_unchanged():
    br = broad_prompts(FakeModel(), FakeTok(), 40, pl.TOPICS, seed=5, batch_size=8, template="raw", progress=False)
    assert len(br) == 38
    passage = ("Sure: \"Write a short factual paragraph (4 sentences) about {t}. ok?\" Write a short factual "
               "paragraph (4 sentences) about {t}. It is widely said that this holds true for many people in many "
               "places.")
    assert br[:4] == [
        {"turns": ["Extract all actions mentioned in the text below. Answer as a JSON list.\n\n"
                   + passage.format(t="science fiction novels")], "source": "broad:extract"},
        {"turns": ["Extract all names of people mentioned in the text below. Answer as a JSON list.\n\n"
                   + passage.format(t="the water cycle")], "source": "broad:extract"},
        {"turns": ["What should a beginner know about the ethics of technology?",
                   "How would you explain this to a beginner?"], "source": "broad:multiturn"},
        {"turns": ["Let's role-play. You are a friendly museum guide. Stay in character.\n\nWhat is the most "
                   "interesting object in your museum?"], "source": "broad:roleplay"}]
    assert digest(br) == "c6a0d572a973736d"


def test_followups_of_a_seed_are_unchanged():
    convs = [{"turns": [f"p{i}"]} for i in range(30)] + [{"turns": ["a", "b"]}]
    add_followups(convs, 0.5, seed=7)
    assert [c["turns"] for c in convs[:6]] == [
        ["p0", "Can you give me another example?"], ["p1", "Can you explain that in simpler terms?"],
        ["p2", "Now explain it to a five-year-old."], ["p3", "Are there any exceptions?"],
        ["p4", "Now explain it to a five-year-old."], ["p5", "Please summarize your answer in three bullet points."]]
    assert digest(convs) == "7826ec8924f51aa3"
    untouched = [{"turns": ["x"]}]
    add_followups(untouched, 0.0, seed=7)
    assert untouched == [{"turns": ["x"]}]


def test_a_broken_list_file_is_one_clear_error():
    bad = json.dumps({"TOPICS": ["a", 3], "ROLES": [["a", "b"]]})
    with pytest.raises(ValueError, match=r"bad.json: TOPICS holds 3"):
        pl.parse_prompt_lists(bad, "bad.json", ("TOPICS",))
    with pytest.raises(ValueError, match=r"bad.json: NAMES must be a non-empty list"):
        pl.parse_prompt_lists(bad, "bad.json", ("NAMES",))
    assert pl.parse_prompt_lists(bad, "bad.json", ("ROLES",)) == {"ROLES": [("a", "b")]}   # arrays -> tuples
