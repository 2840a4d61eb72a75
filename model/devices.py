"""Where tensors live: the one placement rule of the project, and how ranks map to GPUs.

Placement rule (every rank, every mode)
    * **Model device** (``model.device``: ``cpu`` or ``cuda:<i>``): weights, KV caches (stage and draft
      head), the hidden states a forward produces, the draft head's features, and the draft beam's
      working tensors (log-probs, top-k, candidate scores) while a tree is being grown.
    * **Host** (:data:`HOST`, the CPU): everything that is bookkeeping or crosses the wire: draft trees
      (``tokens``, ``parents``, ``scores``, ``depths``), keep-lists and decisions, ancestor matrices,
      attention masks and positions before a forward, message headers and payloads (the wire codec is on
      the host; NCCL copies to the device only inside :class:`pipeline.comm.Comm`), the sampler's generator,
      and the logits verification reads.
    * **Transfers**: one host->device copy per forward input (ids or hidden rows, positions, mask), one
      device->host copy per ``lm_head`` application (``Engine.logits``), one per draft-beam level (the
      chosen parent rows) and one per drafted tree (its candidates). Never one per node: per-node loops
      (``walk_tree``, ``top_nodes_tree``, ``merge_trees``) only touch host tensors.

Every factory call (``torch.tensor``, ``zeros``, ``arange``...) on a rank's decode path names its device
explicitly: :data:`HOST` for bookkeeping, the model's device for model inputs. The CPU-only guard
(``tests/test_device_guard.py``) enforces it by running the decode path under ``torch.device("meta")``,
where a tensor created without a device is a meta tensor that breaks the step.

GPU mapping
    A rank on ``device=cuda`` uses ``cuda:<LOCAL_RANK % device_count>``, or the index that
    ``model.devices`` (comma-separated, one entry per global rank, e.g. ``0,0,1,1,2``) gives it.
    ``comm.backend=nccl`` needs distinct GPUs for the ranks of one host (NCCL cannot connect two ranks on
    one device): :func:`rank_devices` refuses such a plan with one line before any rank connects.
"""
from __future__ import annotations

import torch

HOST = torch.device("cpu")


class DevicePlanError(ValueError):
    """A device assignment that cannot work (names the ranks and the device)."""


def parse_devices(spec: str) -> list[int]:
    """``"0,0,1"`` -> ``[0, 0, 1]``; ``""`` -> ``[]`` (default mapping)."""
    if not spec.strip():
        return []
    try:
        out = [int(x) for x in spec.split(",")]
    except ValueError:
        raise DevicePlanError(f"model.devices={spec!r}: expected comma-separated GPU indices such as 0,0,1,1,2") from None
    if any(i < 0 for i in out):
        raise DevicePlanError(f"model.devices={spec!r}: GPU indices must be >= 0")
    return out


def rank_devices(backend: str, rank: int, local_rank: int, local_world: int, world: int,
                 device_count: int, devices_spec: str = "") -> int:
    """The CUDA index of ``rank``, after checking the whole host's plan.

    ``local_world`` ranks run on this host as global ranks ``rank - local_rank .. + local_world - 1``
    (torchrun's contiguous assignment). Raises :class:`DevicePlanError` when an index does not exist, when
    ``model.devices`` has the wrong length, or when ``backend == "nccl"`` puts two ranks of this host on one
    GPU. Every rank computes the same verdict from its environment, so no rank waits for a peer that
    refused to start.
    """
    if device_count < 1:
        raise DevicePlanError("device=cuda but no CUDA device is visible to this process")
    explicit = parse_devices(devices_spec)
    if explicit and len(explicit) != world:
        raise DevicePlanError(f"model.devices lists {len(explicit)} GPUs but the job has {world} ranks "
                              "(one entry per rank, rank 0 first)")
    first = rank - local_rank
    host = {}
    for lr in range(local_world):
        g = first + lr
        idx = explicit[g] if explicit else lr % device_count
        if idx >= device_count:
            raise DevicePlanError(f"model.devices gives rank {g} cuda:{idx}, but this host has {device_count} "
                                  f"GPU{'s' if device_count != 1 else ''} (cuda:0..cuda:{device_count - 1})")
        host.setdefault(idx, []).append(g)
    if backend == "nccl":
        shared = {i: rs for i, rs in host.items() if len(rs) > 1}
        if shared:
            i, rs = min(shared.items())
            names = ", ".join(map(str, rs))
            raise DevicePlanError(
                f"comm.backend=nccl cannot put several ranks on one GPU: ranks {names} would all use cuda:{i} "
                f"(this host has {device_count} GPU{'s' if device_count != 1 else ''} for {local_world} ranks). "
                "Use comm.backend=gloo (CUDA tensors are staged through host memory), or give each rank its "
                "own GPU with model.devices=...")
    return explicit[rank] if explicit else local_rank % device_count
