"""Decoding modes: each is a small rank-0 strategy; the verification stages run the same worker loop."""
from pipeline.modes.ar import ar_decode
from pipeline.modes.flowspec import ContinuousMode, PrunedMode
from pipeline.modes.naive import naive_decode
from pipeline.modes.pipedec import PipeDecMode
from pipeline.modes.sps import sps_decode
from pipeline.modes.tp import make_tp_decode

DECODERS = {
    "ar": ar_decode,
    "naive": naive_decode,
    "pruned": PrunedMode().decode,
    "continuous": ContinuousMode().decode,
    "pipedec": PipeDecMode().decode,
    "sps": sps_decode,
    "tp": make_tp_decode("tp"),
    "galaxy": make_tp_decode("galaxy"),
}
