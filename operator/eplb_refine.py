"""EPLB refinement: lower each row's most loaded worker without adding slots (pure numpy).

A row is one layer (global policy) or one (layer, node) (hierarchical policy): a run of slots
split into workers of ``slots_per_worker`` consecutive slots, holding every replica of the
experts it serves. Starting from any such placement, a local search repeatedly changes the
heaviest worker ``h`` of each row by the best of two moves, and only when that lowers ``h``
without lifting any other worker to ``h``'s load or above:

- **swap**: exchange one replica of ``h`` with one replica of another worker (slot counts per
  worker stay fixed);
- **re-count**: one slot of a donor expert with >= 2 replicas (the donors whose load per replica
  stays lowest after losing one) takes a replica of an expert ``h`` holds, so that expert's
  replicas shrink everywhere and the donor's grow everywhere (every expert keeps >= 1 replica,
  the row's slot count is unchanged).

Each step strictly lowers the sum of squared worker loads or the row's replica imbalance, so the
search ends; it is capped at ``max_steps`` steps. Every step is vectorised over the rows still
improving, so the cost is a few array operations of size rows x slots_per_worker x slots.
A row's worker loads never get a higher maximum than the placement it started from.
"""

from __future__ import annotations

import numpy as np

_REL_EPS = 1e-9  # relative improvement a move must make (guards against float noise)
_NUM_DONORS = 8  # donor experts a re-count move considers per row and step
_NUM_PARTNERS = 4  # least loaded workers a swap considers per row and step


def _per_replica(weight: np.ndarray, phy2log: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts [R, E], per-slot tokens [R, S]) of a placement."""
    num_rows, num_experts = weight.shape
    offsets = np.arange(num_rows)[:, None] * num_experts
    counts = np.bincount((phy2log + offsets).ravel(), minlength=num_rows * num_experts).reshape(num_rows, num_experts)
    per_replica = weight / np.maximum(counts, 1)
    return counts, per_replica[np.arange(num_rows)[:, None], phy2log]


def _best_swap(slot_load, loads, heavy, spw, num_partners):
    """Per row: (peak after the best swap of a slot of ``heavy`` with a light worker's slot, i, j).

    Partners are the ``num_partners`` least loaded workers; the peak is the larger of the two
    swapped workers' new loads (the others do not change)."""
    num_rows = slot_load.shape[0]
    rows = np.arange(num_rows)
    col = rows[:, None]
    lane = np.arange(spw)
    heavy_slots = heavy[:, None] * spw + lane  # [R, spw]
    light = np.argpartition(loads, num_partners - 1, axis=1)[:, :num_partners]  # [R, K]
    light_slots = (light[:, :, None] * spw + lane).reshape(num_rows, -1)  # [R, K * spw]
    heavy_load = loads[rows, heavy]
    light_load = np.repeat(loads[col, light], spw, axis=1)  # [R, K * spw]
    delta = slot_load[col, heavy_slots][:, :, None] - slot_load[col, light_slots][:, None, :]  # [R, spw, K * spw]
    peak = np.maximum(heavy_load[:, None, None] - delta, light_load[:, None, :] + delta)
    invalid = (delta <= 0) | (np.repeat(light, spw, axis=1) == heavy[:, None])[:, None, :]
    peak = np.where(invalid, np.inf, peak).reshape(num_rows, -1)
    best = np.argmin(peak, axis=1)
    i, j = np.divmod(best, light_slots.shape[1])
    return peak[rows, best], heavy_slots[rows, i], light_slots[rows, j]


def _best_recount(weight, phy2log, counts, loads, heavy, spw):
    """Per row: (upper bound of the row's max after the best re-count move, receiving expert, donor slot).

    The receiver is an expert on ``heavy``; the donor slot is one of a donor expert's replicas on
    another worker. The bound ignores the receiver's gain on workers other than ``heavy``."""
    num_rows, num_slots = phy2log.shape
    num_workers = num_slots // spw
    rows = np.arange(num_rows)
    col = rows[:, None]
    heavy_slots = heavy[:, None] * spw + np.arange(spw)
    receiver = phy2log[col, heavy_slots]  # [R, spw] experts on the heavy worker
    r_count = counts[col, receiver]
    r_weight = weight[col, receiver]
    r_new = r_weight / (r_count + 1)
    r_on_heavy = (receiver[:, :, None] == receiver[:, None, :]).sum(-1)  # [R, spw]
    heavy_load = loads[rows, heavy]
    heavy_after = heavy_load[:, None] + (r_new - r_weight / r_count) * r_on_heavy  # [R, spw]

    num_donors = min(_NUM_DONORS, weight.shape[1])
    key = np.where(counts >= 2, weight / np.maximum(counts - 1, 1), np.inf)  # donor's load per replica after
    donor = np.argpartition(key, num_donors - 1, axis=1)[:, :num_donors]  # [R, D]
    valid = np.isfinite(key[col, donor])
    d_count = counts[col, donor]
    d_weight = weight[col, donor]
    d_new = d_weight / np.maximum(d_count - 1, 1)
    d_loss = d_new - d_weight / np.maximum(d_count, 1)  # [R, D] >= 0, per replica
    d_on = (phy2log.reshape(num_rows, 1, num_workers, spw) == donor[:, :, None, None]).sum(-1)  # [R, D, W]
    grown = loads[:, None, :] + d_loss[:, :, None] * d_on  # [R, D, W] loads with the donor's replicas grown
    is_heavy = np.arange(num_workers)[None, None, :] == heavy[:, None, None]
    others_max = np.where(is_heavy, -np.inf, grown).max(-1)  # [R, D]
    vacated = np.argmin(np.where((d_on > 0) & ~is_heavy, grown, np.inf), axis=-1)  # [R, D]
    vacated_load = grown[col, np.arange(num_donors), vacated]
    valid &= np.isfinite(vacated_load)
    d_on_heavy = d_on[rows, :, heavy]  # [R, D]
    peak = np.maximum(
        np.maximum(others_max[:, None, :], heavy_after[:, :, None] + (d_loss * d_on_heavy)[:, None, :]),
        vacated_load[:, None, :] + np.maximum(r_new[:, :, None] - d_new[:, None, :], 0.0),
    )  # [R, spw, D]
    invalid = ~valid[:, None, :] | (receiver[:, :, None] == donor[:, None, :])
    peak = np.where(invalid, np.inf, peak).reshape(num_rows, -1)
    best = np.argmin(peak, axis=1)
    i, d = np.divmod(best, num_donors)
    donor_expert = donor[rows, d]
    worker = vacated[rows, d]
    on_worker = phy2log.reshape(num_rows, num_workers, spw)[rows, worker] == donor_expert[:, None]
    donor_slot = worker * spw + np.argmax(on_worker, axis=1)
    return peak[rows, best], receiver[rows, i], donor_slot


def refine_rows(
    weight: np.ndarray,  # [R, E] tokens per expert of each row's layer
    phy2log: np.ndarray,  # [R, S] experts held by each row's slots
    slots_per_worker: int,
    max_steps: int = 40,
    stop_at: np.ndarray | None = None,  # [R] stop a row once its max worker load is <= this
    recount: bool = True,
) -> np.ndarray:
    """[R, S] refined placement (see module doc); ``phy2log`` is not modified."""
    phy2log = np.array(phy2log, dtype=np.int64, copy=True)
    num_rows, num_slots = phy2log.shape
    num_workers = num_slots // slots_per_worker
    if num_workers < 2:
        return phy2log
    num_partners = min(_NUM_PARTNERS, num_workers)
    active = np.arange(num_rows)
    for _ in range(max_steps):
        w, phy = weight[active], phy2log[active]
        counts, slot_load = _per_replica(w, phy)
        loads = slot_load.reshape(active.size, num_workers, slots_per_worker).sum(-1)
        heavy = np.argmax(loads, axis=1)
        heavy_load = loads[np.arange(active.size), heavy]
        if stop_at is not None:
            going = heavy_load > stop_at[active]
            active, w, phy, counts, slot_load = active[going], w[going], phy[going], counts[going], slot_load[going]
            loads, heavy, heavy_load = loads[going], heavy[going], heavy_load[going]
        if active.size == 0:
            break
        threshold = heavy_load * (1 - _REL_EPS)
        swap_peak, swap_i, swap_j = _best_swap(slot_load, loads, heavy, slots_per_worker, num_partners)
        use_swap = swap_peak < threshold
        rows = active[use_swap]
        a, b = swap_i[use_swap], swap_j[use_swap]
        phy2log[rows, a], phy2log[rows, b] = phy2log[rows, b], phy2log[rows, a]
        stuck = np.flatnonzero(~use_swap)
        if recount and stuck.size:
            count_peak, receiver, donor_slot = _best_recount(
                w[stuck], phy[stuck], counts[stuck], loads[stuck], heavy[stuck], slots_per_worker
            )
            use_count = count_peak < threshold[stuck]
            phy2log[active[stuck[use_count]], donor_slot[use_count]] = receiver[use_count]
            use_swap[stuck[use_count]] = True
        active = active[use_swap]
        if active.size == 0:
            break
    return phy2log
