"""Training the draft heads (EAGLE-1/2 here; EAGLE-3 in :mod:`draft.train_eagle3`), one module per concern.

The command line is :mod:`draft.train_eagle` (``python -m draft.train_eagle data|features|train``); it only
parses arguments and dispatches here:

    prompt_lists   the prompt material, read from prompt_lists.json / broad_prompt_lists.json
    prompt_files   prompt files (FastChat / ShareGPT / plain text) and exclusion of evaluation prompts
    target         the target model: device, default checkpoint, model/tokenizer, embeddings, features
    generate       generation with the target: batched answers, whole conversations with loss masks
    self_prompts   ``--self-prompts N``: prompts the target writes itself plus templated ones; follow-up turns
    broad_prompts  ``--broad N``: translation, summaries, RAG, extraction, math, code, multi-turn, role-play
    translation_prompts  ``--translate N``: translation prompts from the target's own answers, and back
    dataset        the ``data`` subcommand (prompts -> conversations JSONL, resumable)
    features       the ``features`` subcommand (target features in safetensors shards) and their reader
    records        training records: reading, filtering, the held-out split
    batches        padded batches of conversations, the epoch order
    objective      the head's forward, the EAGLE loss, one optimizer step, held-out evaluation
    eagle_loop     the ``train`` subcommand for EAGLE-1/2 heads (setup, epochs, checkpoints, final evaluation)
    plots          the loss-curve figure

This package file imports nothing, so importing one piece does not load the others.
"""
