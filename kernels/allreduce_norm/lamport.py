"""The Lamport exchange of ``kernels/allreduce_norm`` as Triton helpers, shared by its own kernel and the steered norm's
``AR`` feature (``kernels/steered_rms_norm``: the TP all-reduce inside the steered norm's launch).

A rank's symmetric buffer is ``[2, WORLD, MAX_T, D]`` (two epochs, a plane per sending rank), the sentinel (negative
zero) wherever no push is pending. ``push_row`` stores a token's partial row (its negative zeros as positive ones)
into this rank's plane of every rank's buffer; ``pull_sum`` spins on this rank's buffer until each plane's row holds
no sentinel, adds the planes in rank order in float32 (the same bits on every rank) and writes the sentinel back;
``flip_epoch``, after a launch's programs, lets its last program switch the epoch (``flags[0]``) and zero the
arrivals (``flags[1]``)."""

import triton
import triton.language as tl


@triton.jit
def _bits(v, BITS: tl.constexpr):
    """``v``'s bits as a signed integer (the sentinel, negative zero, is the sign bit alone: ``_sentinel``)."""
    if BITS == 16:
        return v.to(tl.int16, bitcast=True)
    else:
        return v.to(tl.int32, bitcast=True)


@triton.jit
def _sentinel(BITS: tl.constexpr):
    if BITS == 16:
        return -32768
    else:
        return -2147483648


@triton.jit
def epoch_base(p_flags, max_t, WORLD: tl.constexpr, D: tl.constexpr):
    """(this launch's epoch, its buffer's element offset)."""
    epoch = tl.load(p_flags)
    return epoch, epoch.to(tl.int64) * (WORLD * max_t * D)


@triton.jit
def push_row(p_bufs, x, base, rank, t, max_t, o_d, m_d, WORLD: tl.constexpr, D: tl.constexpr):
    """Row ``t`` of this rank's partial ``x`` (the buffers' dtype) into this rank's plane of every rank's buffer."""
    x = tl.where(x == 0, 0.0, x).to(x.dtype)  # -0 -> +0: the sentinel is never data
    for r in tl.static_range(WORLD):
        # the buffers are 16-byte aligned (symmetric memory): said, so the pushes are 128-bit stores, not one store
        # per element (a loaded pointer's alignment is unknown to the compiler)
        peer = tl.multiple_of(tl.load(p_bufs + r).to(tl.pointer_type(x.dtype)), 16)
        tl.store(peer + base + (rank * max_t + t) * D + o_d, x, mask=m_d)


@triton.jit
def pull_sum(p_bufs, base, rank, t, max_t, o_d, m_d, dtype: tl.constexpr, WORLD: tl.constexpr, D: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Row ``t`` summed over the ranks' planes of this rank's buffer, in rank order in float32, each plane's row
    waited for (no sentinel left) and reset to the sentinel once read."""
    BITS: tl.constexpr = dtype.primitive_bitwidth
    own = tl.multiple_of(tl.load(p_bufs + rank).to(tl.pointer_type(dtype)), 16)
    sentinel = _sentinel(BITS)
    zero_bits = _bits(tl.zeros((BLOCK_D,), dtype), BITS)
    reset = (zero_bits + sentinel).to(zero_bits.dtype).to(dtype, bitcast=True)  # a row of the sentinel
    s = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r in tl.static_range(WORLD):  # rank order: the same sum on every rank
        p = own + base + (r * max_t + t) * D + o_d
        v = tl.load(p, mask=m_d, other=0.0, volatile=True)
        while tl.sum(((_bits(v, BITS) == sentinel) & m_d).to(tl.int32), axis=0) > 0:
            v = tl.load(p, mask=m_d, other=0.0, volatile=True)
        s += v.to(tl.float32)
        tl.store(p, reset, mask=m_d)
    return s


@triton.jit
def flip_epoch(p_flags, epoch, programs):
    """After this program's pulls: the launch's last program to arrive switches the epoch for the next launch."""
    tl.debug_barrier()
    if tl.atomic_add(p_flags + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(p_flags + 1, 0)
        tl.store(p_flags, 1 - epoch)
