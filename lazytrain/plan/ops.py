"""The op sequence of one micro-batch and the window rules shared by the MILP and the simulator.

Execution indices: 0 = embed, 1..L = decoder blocks, L+1 = head (final norm + lm_head + loss,
forward and backward back to back). One micro-batch runs the ops

    F0, F1, ..., FL, H, BL, ..., B1, B0

Each op opens a *window*: the compute of that op runs while the links carry the transfers the
window is charged with; the next window starts when all of them are done (the executor waits for
the prefetch of the layer it needs). The window's length is the max over its resources; a step is
the sum of its windows. Transfers are charged as follows (the sequence is cyclic, so the last
window prefetches the next step's first layer):
- parameters of the op after this one (prefetch), from host (h2d) or NVMe (nvme_read + h2d);
  a recomputed block that is not the last of its segment is fetched twice (recompute + backward);
  the executor's streamer still holds a layer used again soon, and four such cases are counted:
  where the weights did not change (between micro-batches; LoRA: across steps too) the
  embedding's next forward is fetched in the window before its backward, which reads no weights
  (`held_into_next_cycle`), else in the last window; with a prefetch depth >= 2 (a layer whose next
  use comes after one other use) the last block's backward (after the head; unless a longer
  recompute segment runs in between) and the backward of a segment's second-to-last block
  (after the last block's recompute + backward), and the first block's next forward after its
  backward when the embedding's forward in between was fetched early (`micro_batch_kinds`).
  This is exact when every layer streams at depth 2 and an upper bound otherwise: with
  device-resident layers in between, or at depth >= 3, the streamer holds layers longer and
  fetches less than charged here;
  a tied head's weights are its own (on its param tier) plus the embedding's matrix (on the
  embedding's tier: counted once, with the embedding, when resident; fetched for the head when
  streamed), see `weight_parts`;
- a kept activation leaves the device in the window after it is produced (d2h, + nvme_write);
  it comes back in the window before the backward op that needs it (+ nvme_read, h2d);
- a block's gradients leave in the window after its backward (d2h); with gradient accumulation on
  NVMe they are read, summed and written back there;
- in the last micro-batch of a step the host optimizer updates a layer (CPU time; NVMe-resident
  state is read and written back; new weights go back to their tier) in the window after its
  backward; with gradient clipping (`job.clip_grad`) updates wait for the global norm, so layer
  j's runs in the window of F_{j-1} (the next step's forward, cyclically) and the embedding's in
  the last window (`update_window`). Approximations: the embedding's clipped update overlaps
  B_0 here but follows it (and the norm) in the executor, and a streamed layer's fetch waits for
  its update, which the window overlaps with it; both are small next to a block's update.
"""

from __future__ import annotations

from dataclasses import dataclass

FWD, HEAD, BWD = "F", "H", "B"


@dataclass(frozen=True)
class Op:
    kind: str   # F | H | B
    layer: int  # execution index


def weight_parts(costs, j: int) -> tuple[tuple[int, int], ...]:
    """(owner layer, bytes) of the weights layer j computes with. Its own live on its param tier;
    a tied head also borrows the embedding's matrix, which lives on layer 0's tier (the executor's
    `borrows`: one buffer, resident with the embedding or fetched for the head)."""
    c = costs.layers[j]
    borrowed = c.param_bytes - c.param_store_bytes
    if borrowed <= 0:
        return ((j, c.param_bytes),)
    assert c.kind == "head", f"{c.name}: only a head tied to the embedding borrows weights"
    return ((j, c.param_store_bytes), (0, borrowed))


def grad_d2h_bytes(costs, j: int) -> int:
    """Gradient bytes of layer j copied off the device (its d2h). All of them, except with
    `direct_grads` (a CPU device, a 16-bit master dtype, one micro-batch, no clipping: the update
    reads them where backward left them). Even then, with a tied head, the embedding's gradients
    are copied (the head's share of the matrix is added to them) and so is that share."""
    c = costs.layers[j]
    if not costs.direct_grads:
        return c.grad_device_bytes
    L = costs.num_blocks
    if len(weight_parts(costs, L + 1)) == 1:   # untied
        return 0
    if j == 0:
        return c.grad_device_bytes
    if j == L + 1:
        return weight_parts(costs, L + 1)[1][1]   # the borrowed matrix's gradient
    return 0


def op_sequence(num_blocks: int) -> list[Op]:
    L = num_blocks
    return ([Op(FWD, j) for j in range(0, L + 1)] + [Op(HEAD, L + 1)]
            + [Op(BWD, j) for j in range(L, -1, -1)])


def fwd_window(num_blocks: int, j: int) -> int:
    """Window index of F_j."""
    return j


def bwd_window(num_blocks: int, j: int) -> int:
    """Window index of B_j (j in 0..L)."""
    return (num_blocks + 2) + (num_blocks - j)


def after(num_blocks: int, k: int) -> int:
    """The window after k; the last window's 'after' is itself (drain in place)."""
    K = 2 * num_blocks + 3
    return min(k + 1, K - 1)


def refetch_last_kept(depth: int) -> int:
    """How many blocks at the end of a recompute segment are fetched once for recompute and
    backward together: the last always (one use), the second-to-last too with depth >= 2 (its
    backward follows its recompute after one other use, and the streamer keeps it). A segment
    (s, e] re-fetches blocks s+1 .. e - refetch_last_kept(depth)."""
    return 2 if depth >= 2 else 1


def ends_long_segment(num_blocks: int, s: int, e: int) -> bool:
    """A recompute segment (s, e] of several blocks ending at the last block: its backward then
    follows a recompute of the others, and the last block is fetched again (no reuse)."""
    return e == num_blocks and s < num_blocks - 1


def held_into_next_cycle(final: bool, trains_base: bool) -> bool:
    """Whether the next micro-batch's F_0 can be fetched before this one ends: always, unless the
    step's update changes the embedding's weights (the final micro-batch, full training).

    B_0 itself reads no weights (an embedding's gradient needs only the token ids and the
    gradient of its output), so nothing is fetched for it (assumed: HF embeddings; the executor
    warns where an embedding may read them, and then fetches them for B_0 too). The window before
    B_0 (B_1's) fetches the next F_0's weights when they are held into the next cycle; otherwise
    they are fetched after the update, in the last window. Either way the embedding crosses once
    per micro-batch."""
    return not final or not trains_base


def fetched_early(m: int, trains_base: bool) -> bool:
    """Whether micro-batch m's embedding was fetched by the micro-batch before it (for the first,
    the previous step's last): `held_into_next_cycle` of that one."""
    return held_into_next_cycle(m == 0, trains_base)


def streaming_reserve(slots: list[int], num_blocks: int, depth: int, cached: bool = False,
                      embed_recomputed: bool = False) -> int:
    """Device bytes of the streamer's buffers, from each layer's slot (the weights one use of it
    brings: `weight_parts` not on the device; 0 when resident). The streamer holds the layer in
    use and the next depth - 1 streamed ones (resident layers are skipped), and between the head
    and the embedding lies every streamed block's use either way, so with at least depth - 1
    streamed blocks at most one of those two is held at once: the largest slot of any layer plus
    depth - 1 of the largest block's (Llama-3-8B with everything streamed at depth 2: embedding
    1.0 + block 0.44 GB, not 2 x 1.0). `cached` (a CPU device, JobCosts.caches_stream_buffers):
    freed buffers are kept for reuse, and the embedding's or head's stays cached while depth blocks
    stream: one more block's. Never more than depth of the largest (with fewer streamed blocks:
    that), which the streamer enforces by dropping cached buffers first. `embed_recomputed`: a hand
    plan that recomputes the embedding (the planner never makes one) re-runs it right after the
    head, so both can be held at once: depth of the largest."""
    if not slots:
        return 0
    top = depth * max(slots)
    blocks = slots[1:num_blocks + 1]
    if embed_recomputed or sum(1 for b in blocks if b > 0) < depth - 1:
        return top
    return min(top, max(slots) + (depth - 1 + int(cached)) * max(blocks, default=0))


def micro_batch_kinds(grad_accum: int, trains_base: bool) -> list[tuple[bool, bool, int]]:
    """The kinds of micro-batch in a step, as (final, after_held, count). `after_held`: the micro-
    batch before (for the first, the previous step's last) fetched this one's embedding early
    (`held_into_next_cycle`), so its uses ended with the first block's backward and, at a prefetch
    depth >= 2, the streamer still holds that block for this one's F_1 (one use, F_0, in between):
    the window of F_0 then fetches nothing (`first_block_held`)."""
    kinds: dict[tuple[bool, bool], int] = {}
    for m in range(grad_accum):
        key = (m == grad_accum - 1, fetched_early(m, trains_base))
        kinds[key] = kinds.get(key, 0) + 1
    return [(final, held, n) for (final, held), n in kinds.items()]


def first_block_held(after_held: bool, depth: int) -> bool:
    """Whether F_1's weights are still on the device from the micro-batch before (see
    `micro_batch_kinds`)."""
    return after_held and depth >= 2


def update_window(num_blocks: int, j: int, k_backward: int, clip_grad: bool) -> int:
    """Window of layer j's optimizer update and the I/O that goes with it. Without clipping the
    executor updates a layer as soon as its gradients have landed: the window after its backward.
    With clipping every update waits for the global norm, known after the whole backward; they
    then run first layers first, while the next step's forward runs, and layer j's forward waits
    for its own: the embedding's at the end of the backward (the last window, drained in place),
    layer j's during the forward of layer j - 1 (in steady state, the same cycle)."""
    if not clip_grad:
        return after(num_blocks, k_backward)
    return fwd_window(num_blocks, j - 1) if j >= 1 else 2 * num_blocks + 2


def head_peak_bytes(costs) -> int:
    """The head's own device bytes at its most (beyond what the layers before it keep): what it
    saves, plus the larger of two moments of its backward: the log-softmax's (its transient bytes,
    before any weight gradient exists) and the lm_head's, whose weight gradient (`grads_in_flight`)
    is made next to the logits gradient after the saved log-softmax was freed (`bwd_tail_bytes`)."""
    head = costs.layers[costs.num_blocks + 1]
    late = head.bwd_tail_bytes + grads_in_flight(costs, costs.num_blocks + 1, costs.num_blocks + 1)
    return max(head.act_bytes + head.bwd_transient_bytes, late)


def grads_in_flight(costs, first: int, last: int) -> int:
    """Most weight-gradient bytes on the device while layers last..first run backward (in that
    order): a layer's own and the previous one's (the layer after it), which may still be leaving
    (the executor waits before a third); on a CPU device only its own (`costs.grads_inline`: the
    previous one's left inline before this backward began). The head is the first backward:
    nothing before it."""
    layers = costs.layers
    n = len(layers)
    prev = not costs.grads_inline
    return max(layers[j].grad_device_bytes + (layers[j + 1].grad_device_bytes if prev and j + 1 < n else 0)
               for j in range(first, last + 1))
