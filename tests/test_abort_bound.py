"""scripts/abort_bound.py: which stage forwards the bound cuts, and by how much (docs/results.md §93)."""
from scripts.abort_bound import cut_dead_forwards, messages


def _logs():
    """Rank 0, stage 1, stage 2; two segments. The first dies in flight (stage 2 computes none of its rows), the
    second lives on. Stage 1's forwards: [0, 8) and [8, 16) seconds; 8 layers, 1 s each."""
    s1 = [("recv", 0), ("poll", 0), ("compute", 16, 100), ("send", 2, 16, 0),
          ("recv", 0), ("poll", 0), ("compute", 16, 116), ("send", 2, 16, 0)]
    s2 = [("recv", 1), ("poll", 1), ("send", 0, 0, 0),
          ("recv", 1), ("poll", 1), ("compute", 16, 100), ("send", 0, 16, 0)]
    spans = {(1, 2): (0.0, 8.0), (1, 6): (8.0, 16.0)}
    return [[], s1, s2], spans


def seconds(r, op):
    return 8.0


def test_messages_pair_each_receive_with_its_poll_and_forward():
    logs, _ = _logs()
    assert messages(logs[1], 0) == [{"compute": 2, "held": 0}, {"compute": 6, "held": 0}]
    assert messages(logs[2], 1) == [{"compute": None, "held": 1}, {"compute": 5, "held": 1}]


def test_a_dead_forward_stops_after_the_layer_in_which_its_decision_arrived():
    logs, spans = _logs()
    logs[2][4] = ("poll", 2)                    # a second decision reaches stage 1 during the living forward
    new, cut = cut_dead_forwards(logs, spans, {1: [2.5, 9.5]}, seconds, layers=8)
    assert new[1][2] == ("host", 3.0)          # layers 0, 1, 2 computed: the decision came during layer 2
    assert cut == 5.0
    assert new[1][6] == logs[1][6]             # the living segment's forward is untouched
    assert new[2] == logs[2] and logs[1][2] == ("compute", 16, 100)    # the input is not modified


def test_no_cut_for_a_decision_before_the_forward_or_after_it():
    logs, spans = _logs()
    for when in (-1.0, 8.0, 9.0):               # held before the forward (it would not have been computed) / too late
        new, cut = cut_dead_forwards(logs, spans, {1: [when]}, seconds, layers=8)
        assert new == logs and cut == 0.0, when


def test_bound_first_and_last():
    logs, spans = _logs()
    logs[2][1] = ("poll", 2)                    # stage 2 held two decisions: either could have killed the segment
    first, c1 = cut_dead_forwards(logs, spans, {1: [1.5, 6.5]}, seconds, layers=8, bound="first")
    last, c2 = cut_dead_forwards(logs, spans, {1: [1.5, 6.5]}, seconds, layers=8, bound="last")
    assert first[1][2] == ("host", 2.0) and last[1][2] == ("host", 7.0) and c1 > c2
