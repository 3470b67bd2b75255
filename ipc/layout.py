"""The byte layout an engine rank registers, as LAYOUT.md defines it.

A layout travels in handshakes, so it is a set of small frozen msgspec Structs
and nothing else: no addresses, no tensors. Families (attention, MLA, Mamba1,
Mamba2, GDN) differ only in the segments their builders produce; nothing
downstream branches on the family.

::

    region r (one buffer): | page 0 | page 1 | ... | page num_blocks-1 |

    attention view of a page (sub_blocks kernel blocks, blocks-first):
        | kernel block 0        | kernel block 1        | ...
        | k [heads][kbs][hd] | v [heads][kbs][hd] | ...

    mamba view of the same page size (one sequence's whole state):
        | conv x | conv B | conv C | temporal [heads][...] | padding |

Every segment is ``[units_local][unit_bytes]``; which units a rank holds is
the sharding rule (:func:`unit_range`), shared by all families.

Units and offsets: the one convention (the client, the daemon and the vLLM
adapter all follow it; nothing else defines it):

* **Block ids** (``read``, ``hold``, completions' ``invalid_block_ids``, vLLM's
  block tables) name **pages**: vLLM's logical blocks, ``0 <= id <
  num_blocks``. Never kernel blocks.
* **Tokens** (``skip_tokens``, ``num_tokens``) count tokens of the request;
  ``skip_tokens`` is a whole number of the local side's pages
  (``sub_blocks * block_tokens`` tokens), the grain of a prefix-cache hit.
* **A view** is what one segment list describes: a kernel block of an
  attention group (``sub_blocks`` per page, ``kernel_block_bytes`` each), or
  the whole page of a mamba group (one view per page). View ``k`` of page
  ``b`` starts at ``b * page_bytes + k * view_bytes`` in every region
  (:func:`view_offsets`).
* **Segment offsets** are relative to the start of their view, for every
  group kind: ``region base + view start + segment offset + unit * unit_bytes``
  is the address of a unit.

P and D may differ in ``sub_blocks`` (it follows per-rank Mamba state size):
attention views pair by token, mamba views page to page (LAYOUT.md section 5).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
from numpy.typing import NDArray

from .region_checks import as_int64, extremes, first_repeat, first_shared_overlap

Sharding = Literal["split", "replicated"]
GroupKind = Literal["attention", "mamba"]

LAYOUT_VERSION = 1
# Bounds that keep every offset an int64 and reject layouts no machine has.
MAX_REGION_BYTES = 1 << 44
MAX_REGIONS = 1 << 16
#: Segments one group may have, and groups one layout may have. Real models
#: have at most a few segments per view (Mamba2: x, B, C and the temporal
#: state) and a few groups (vLLM's hybrid manager: one per layer type and
#: ratio); these bounds are far above both, and keep a layout's checks and
#: every per-segment loop downstream small whatever the message holds.
MAX_SEGMENTS_PER_GROUP = 64
MAX_GROUPS = 256


class LayoutError(ValueError):
    """A layout or a builder's parameters are inconsistent."""


class IncompatibleLayout(ValueError):
    """Two engines' layouts describe different models; the message names the field."""

    def __init__(self, field: str, local: object, remote: object) -> None:
        super().__init__(f"incompatible peer: {field} differs (local {local!r}, remote {remote!r})")
        self.field = field
        self.local = local
        self.remote = remote


class Segment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A run of ``[units_local][unit_bytes]`` bytes inside a view.

    ``offset`` is relative to the start of the view (a kernel block of an
    attention group, the page of a mamba group: see "Units and offsets"
    above). ``regions`` limits the segment to some regions (K and V kept in
    separate tensors); empty means every region.
    """

    name: str
    offset: int
    nbytes_local: int
    units_total: int
    sharding: Sharding = "split"
    regions: tuple[int, ...] = ()


class Group(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One KV-cache group: how its block ids view a page.

    Attention groups see a page as ``sub_blocks`` kernel blocks of
    ``kernel_block_bytes``, each holding ``block_tokens`` tokens; mamba groups
    see the whole page (``sub_blocks`` 1, ``block_tokens`` 0).

    ``window_tokens`` > 0 marks a sliding-window attention group: the engine
    keeps only the pages of the last ``window_tokens`` tokens, so a block list
    of this group names the *tail* of the request's pages (it ends with the
    page of the request's last token, ``num_tokens``) on both sides, and a read
    pairs the two tails by token (:func:`kvsidecar.daemon.planner.pair_group`).
    Fields at their defaults stay off the wire: a group without a window
    encodes as before ``window_tokens`` existed, so older peers still accept it.
    """

    kind: GroupKind
    segments: tuple[Segment, ...]
    sub_blocks: int = 1
    kernel_block_bytes: int = 0
    block_tokens: int = 0
    window_tokens: int = 0


class Layout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one engine rank's KV memory looks like.

    ``model`` holds the model-level facts (name, dtype, head counts...) that
    must agree between peers; :func:`check_compatible` compares them.
    """

    family: str
    tp_size: int
    num_regions: int
    num_blocks: int
    page_bytes: int
    groups: tuple[Group, ...]
    model: dict[str, str | int] = {}
    version: int = LAYOUT_VERSION

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    def with_blocks(self, num_blocks: int) -> Layout:
        """The same layout with a different cache size (cache size is per engine)."""
        out = msgspec.structs.replace(self, num_blocks=num_blocks)
        validate(out)
        return out


def view_bytes(layout: Layout, group: Group) -> int:
    """Bytes of one view of ``group``: a kernel block, or the whole page (mamba)."""
    return group.kernel_block_bytes if group.kind == "attention" else layout.page_bytes


def view_offsets(layout: Layout, group: Group, block_ids: NDArray[np.int64]) -> NDArray[np.int64]:
    """Region-relative start of every view the pages ``block_ids`` hold, in token
    order (page by page, kernel block by kernel block): the one place that turns
    block ids into byte offsets. Add a segment's ``offset`` to reach the segment."""
    if group.sub_blocks == 1:  # one view per page (mamba; attention on equal tp): no outer sum
        first: NDArray[np.int64] = block_ids * layout.page_bytes
        return first
    ks = np.arange(group.sub_blocks, dtype=np.int64) * view_bytes(layout, group)
    out: NDArray[np.int64] = (block_ids[:, None] * layout.page_bytes + ks[None, :]).reshape(-1)
    return out


# --------------------------------------------------------------------------
# The sharding rule (LAYOUT.md section 3)
# --------------------------------------------------------------------------


def units_local(seg: Segment, tp_size: int) -> int:
    if seg.sharding == "replicated":
        return seg.units_total
    return seg.units_total // tp_size if tp_size <= seg.units_total else 1


def unit_range(seg: Segment, tp_size: int, rank: int) -> tuple[int, int]:
    """The half-open range of units rank ``rank`` of a ``tp_size`` engine holds."""
    u = seg.units_total
    if seg.sharding == "replicated":
        return 0, u
    if tp_size <= u:
        per = u // tp_size
        return rank * per, (rank + 1) * per
    first = rank * u // tp_size
    return first, first + 1


def unit_bytes(seg: Segment, tp_size: int) -> int:
    return seg.nbytes_local // units_local(seg, tp_size)


def segment_regions(seg: Segment, num_regions: int) -> tuple[int, ...]:
    return seg.regions if seg.regions else tuple(range(num_regions))


# --------------------------------------------------------------------------
# Validation and compatibility
# --------------------------------------------------------------------------


def validate(layout: Layout) -> Layout:
    """Reject a layout whose numbers cannot describe real memory.

    Its cost grows with the segments and the regions segments name, never with
    ``num_regions``: a segment without ``regions`` lives in every region at the
    same offsets, so those segments are checked against each other once.
    """
    _check_sizes(layout)
    for gi, g in enumerate(layout.groups):
        where = f"group {gi} ({g.kind})"
        view = _group_view(layout, g, where)
        if not g.segments:
            raise LayoutError(f"{where}: no segments")
        if len(g.segments) > MAX_SEGMENTS_PER_GROUP:
            raise LayoutError(f"{where}: {len(g.segments)} segments exceed the limit "
                              f"({MAX_SEGMENTS_PER_GROUP} per group)")
        names = [s.name for s in g.segments]
        if len(set(names)) != len(names):
            raise LayoutError(f"{where}: duplicate segment names {names}")
        named = [_check_segment(layout, g, s, f"{where} segment {s.name!r}", view)
                 for s in g.segments]
        region = _first_overlap(g.segments, named)
        if region is not None:
            raise LayoutError(f"{where}: segments overlap in region {region}")
    return layout


def _first_overlap(segments: tuple[Segment, ...],
                   named: list[NDArray[np.int64] | None]) -> int | None:
    """A region in which two of ``segments`` overlap, or None.

    Segments in every region (no ``regions``) are checked against each other
    once, not once per region; a segment naming its regions is checked against
    those (it shares every region with them) and, region by region, against
    the other segments naming that region, in one vectorised pass
    (:func:`~kvsidecar.ipc.region_checks.first_shared_overlap`): O(segments *
    log segments) in Python, O(the regions segments name) in numpy. Segments
    passed :func:`_check_segment`, which gave their regions as arrays (``named``).
    """
    everywhere = sorted((s.offset, s.offset + s.nbytes_local) for s in segments
                        if not s.regions)
    for (_, e0), (b1, _) in itertools.pairwise(everywhere):
        if b1 < e0:
            return 0
    starts = [b for b, _ in everywhere]
    spans: list[tuple[NDArray[np.int64], int, int]] = []
    for s, regions in zip(segments, named, strict=True):
        if regions is None:
            continue
        b, e = s.offset, s.offset + s.nbytes_local
        # ``everywhere`` does not overlap itself, so its ends rise with its starts:
        # only the span starting last at or before b, and the next, can overlap.
        i = bisect.bisect_right(starts, b)
        if (i and everywhere[i - 1][1] > b) or (i < len(everywhere) and everywhere[i][0] < e):
            return int(regions.min())
        spans.append((regions, b, e))
    return first_shared_overlap(spans)


def _check_sizes(layout: Layout) -> None:
    """The layout's own numbers: positive, within the limits, at least one group."""
    tp = layout.tp_size
    if tp < 1:
        raise LayoutError(f"tp_size must be >= 1, got {tp}")
    if layout.num_regions < 1:
        raise LayoutError(f"num_regions must be >= 1, got {layout.num_regions}")
    if layout.num_blocks < 1:
        raise LayoutError(f"num_blocks must be >= 1, got {layout.num_blocks}")
    if layout.page_bytes < 1:
        raise LayoutError(f"page_bytes must be >= 1, got {layout.page_bytes}")
    if layout.region_bytes > MAX_REGION_BYTES or layout.num_regions > MAX_REGIONS:
        raise LayoutError(
            f"{layout.num_regions} regions of {layout.region_bytes} B exceed the limits "
            f"({MAX_REGIONS} regions of {MAX_REGION_BYTES} B)"
        )
    if not layout.groups:
        raise LayoutError("a layout needs at least one group")
    if len(layout.groups) > MAX_GROUPS:
        raise LayoutError(f"{len(layout.groups)} groups exceed the limit ({MAX_GROUPS})")


def _group_view(layout: Layout, g: Group, where: str) -> int:
    """The bytes one of ``g``'s views spans (a kernel block, or a whole mamba
    page), once its kind's numbers are checked."""
    if g.kind == "attention":
        if g.sub_blocks > layout.page_bytes:
            raise LayoutError(f"{where}: {g.sub_blocks} kernel blocks cannot fit a page")
        if g.window_tokens < 0:
            raise LayoutError(f"{where}: window_tokens must be >= 0")
        if g.sub_blocks < 1 or g.kernel_block_bytes < 1 or g.block_tokens < 1:
            raise LayoutError(
                f"{where}: sub_blocks, kernel_block_bytes and block_tokens must be >= 1"
            )
        if g.sub_blocks * g.kernel_block_bytes > layout.page_bytes:
            raise LayoutError(
                f"{where}: {g.sub_blocks} kernel blocks of {g.kernel_block_bytes} B "
                f"exceed the page ({layout.page_bytes} B)"
            )
        return g.kernel_block_bytes
    if g.kind == "mamba":
        if g.sub_blocks != 1 or g.window_tokens:
            raise LayoutError(f"{where}: mamba groups have sub_blocks 1 and no window")
        return layout.page_bytes
    raise LayoutError(f"{where}: unknown kind {g.kind!r}")  # pragma: no cover - msgspec


def _check_segment(layout: Layout, g: Group, s: Segment, sw: str,
                   view: int) -> NDArray[np.int64] | None:
    """One segment's numbers against its group and view, and the regions it
    names (in range, each once: returned as an array, None when it names
    none); overlaps are the caller's."""
    tp = layout.tp_size
    if s.units_total < 1:
        raise LayoutError(f"{sw}: units_total must be >= 1")
    if s.sharding == "split" and tp <= s.units_total and s.units_total % tp:
        raise LayoutError(
            f"{sw}: {s.units_total} units cannot be split evenly over tp {tp}"
        )
    if s.sharding == "split" and tp > s.units_total and tp % s.units_total:
        raise LayoutError(
            f"{sw}: tp {tp} replicates {s.units_total} units unevenly (tp must be a "
            "multiple of the unit count when it exceeds it)"
        )
    n = units_local(s, tp)
    if s.nbytes_local < 1 or s.nbytes_local % n:
        raise LayoutError(f"{sw}: {s.nbytes_local} B is not a whole number of {n} units")
    if g.kind == "attention" and (s.nbytes_local // n) % g.block_tokens:
        raise LayoutError(f"{sw}: a unit is not a whole number of {g.block_tokens} tokens")
    if s.offset < 0 or s.offset + s.nbytes_local > view:
        end = s.offset + s.nbytes_local
        raise LayoutError(f"{sw}: [{s.offset}, {end}) outside its view")
    if not s.regions:
        return None
    regions = as_int64(s.regions)  # None: a number beyond int64, out of range
    lo, hi = (min(s.regions), max(s.regions)) if regions is None else extremes(regions)
    if lo < 0 or hi >= layout.num_regions:
        raise LayoutError(f"{sw}: region {lo if lo < 0 else hi} out of range")
    assert regions is not None  # in range: they fit int64
    twice = first_repeat(regions)
    if twice is not None:
        raise LayoutError(f"{sw}: region {twice} named twice")
    return regions


class AllRegions:
    """The regions of a segment that names none (it lives in every region) as a
    fingerprint fact, without building the ``n``-long tuple it stands for.

    Equal to an ``AllRegions`` of the same ``n`` (O(1)) and to a tuple naming
    exactly ``0 .. n-1`` (O(the tuple), which is input already there), so a
    segment naming every region still matches one naming none, as before.
    :meth:`expanded` is the tuple's repr, what fingerprints hash (they stay
    what they were); ``repr`` is short, for error messages.
    """

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AllRegions):
            return self.n == other.n
        if isinstance(other, tuple):
            return len(other) == self.n and other == tuple(range(self.n))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(range(self.n)))  # equal to that tuple, so hashed alike

    def __repr__(self) -> str:
        return f"<all {self.n} regions>"

    def expanded(self) -> str:
        """``repr(tuple(range(n)))``: what a fingerprint hashes for this fact (O(n))."""
        return repr(tuple(range(self.n)))


def fingerprint_fields(layout: Layout) -> dict[str, object]:
    """The model-level facts two peers must share, flat and named.

    Cache size, tp size, page size, kernel blocks per page and per-rank byte
    counts are left out: they legitimately differ between P and D. Costs
    O(groups + segments + the regions segments name), never O(``num_regions``):
    a segment in every region has an :class:`AllRegions` fact.
    """
    out: dict[str, object] = {"version": layout.version, "family": layout.family}
    for k in sorted(layout.model):
        out[f"model.{k}"] = layout.model[k]
    out["num_regions"] = layout.num_regions
    out["num_groups"] = len(layout.groups)
    for gi, g in enumerate(layout.groups):
        out[f"group[{gi}].kind"] = g.kind
        out[f"group[{gi}].block_tokens"] = g.block_tokens
        if g.window_tokens:  # absent for full attention: older fingerprints stay valid
            out[f"group[{gi}].window_tokens"] = g.window_tokens
        out[f"group[{gi}].segments"] = tuple(s.name for s in g.segments)
        for s in g.segments:
            p = f"group[{gi}].{s.name}"
            out[f"{p}.units_total"] = s.units_total
            out[f"{p}.sharding"] = s.sharding
            out[f"{p}.unit_bytes"] = unit_bytes(s, layout.tp_size)
            out[f"{p}.regions"] = s.regions if s.regions else AllRegions(layout.num_regions)
    return out


def fingerprint_of(fields: dict[str, object]) -> str:
    """The fingerprint of :func:`fingerprint_fields`' facts: a short hash of their
    sorted reprs (an :class:`AllRegions` hashed as the tuple it stands for, so
    the value is the same as when the tuple was built). O(``num_regions``)
    where a segment is in every region: computed once per registration
    (:class:`Fingerprinted`), not per handshake."""
    facts = sorted((k, v.expanded() if isinstance(v, AllRegions) else repr(v))
                   for k, v in fields.items())
    return hashlib.sha256(msgspec.json.encode(facts)).hexdigest()[:16]


def fingerprint(layout: Layout) -> str:
    """A short hash of :func:`fingerprint_fields`, cheap to compare first."""
    return fingerprint_of(fingerprint_fields(layout))


@dataclass(frozen=True, eq=False)
class Fingerprinted:
    """A layout with its :func:`fingerprint_fields` and :func:`fingerprint`,
    computed once (:func:`fingerprinted`, at registration): every handshake
    compares a peer against them (:func:`check_compatible`) at a cost that does
    not grow with ``num_regions``. Build it with :func:`fingerprinted` only, so
    the three cannot disagree."""

    layout: Layout
    fields: dict[str, object]
    fingerprint: str


def fingerprinted(layout: Layout) -> Fingerprinted:
    """``layout`` with its fingerprint facts and fingerprint (O(``num_regions``) once)."""
    fields = fingerprint_fields(layout)
    return Fingerprinted(layout, fields, fingerprint_of(fields))


def as_fingerprinted(layout: Layout | Fingerprinted) -> Fingerprinted:
    """``layout`` as it is when it came :class:`Fingerprinted` (a registration's),
    else :func:`fingerprinted` (which hashes it)."""
    return layout if isinstance(layout, Fingerprinted) else fingerprinted(layout)


def check_compatible(local: Layout | Fingerprinted, remote: Layout | Fingerprinted) -> None:
    """Raise :class:`IncompatibleLayout` naming the first differing model fact.

    Either side may come :class:`Fingerprinted` (its facts are not built again).
    """
    compare_facts(_facts(local), _facts(remote), _layout(local).tp_size,
                  _layout(remote).tp_size)


def compare_facts(local: dict[str, object], remote: dict[str, object], local_tp: int,
                  remote_tp: int) -> None:
    """:func:`check_compatible` on facts already built (:func:`fingerprint_fields`)
    and the two tp sizes: O(the facts), an :class:`AllRegions` compared in O(1)."""
    for key in list(local) + [k for k in remote if k not in local]:
        if local.get(key) != remote.get(key):
            raise IncompatibleLayout(key, local.get(key), remote.get(key))
    big, small = max(local_tp, remote_tp), min(local_tp, remote_tp)
    if big % small:
        raise IncompatibleLayout("tp_size", local_tp, remote_tp)


def _facts(x: Layout | Fingerprinted) -> dict[str, object]:
    return x.fields if isinstance(x, Fingerprinted) else fingerprint_fields(x)


def _layout(x: Layout | Fingerprinted) -> Layout:
    return x.layout if isinstance(x, Fingerprinted) else x


# --------------------------------------------------------------------------
# Builders, one per model family
# --------------------------------------------------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "uint8": 1}


def _dtype_bytes(dtype: str, what: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        known = sorted(DTYPE_BYTES)
        raise LayoutError(f"{what}: unknown dtype {dtype!r}; known: {known}") from None


def _positive(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v < 1:
            raise LayoutError(f"{k} must be a positive integer, got {v!r}")


def _local_units(total: int, tp: int, what: str) -> int:
    if tp <= total:
        if total % tp:
            raise LayoutError(f"{what}: {total} cannot be split evenly over tp {tp}")
        return total // tp
    if tp % total:
        raise LayoutError(f"{what}: tp {tp} is not a multiple of {total}, so ranks cannot "
                          "share units evenly")
    return 1


def _check_tp_rank(tp_size: int) -> None:
    _positive(tp_size=tp_size)


def _state_params(conv_kernel: int, conv_dtype: str, ssm_dtype: str) -> tuple[int, int, int]:
    """(conv rows kept, conv dtype bytes, temporal dtype bytes) of a recurrent layer."""
    if conv_kernel < 2:
        raise LayoutError(f"conv_kernel must be >= 2, got {conv_kernel}")
    return (conv_kernel - 1, _dtype_bytes(conv_dtype, "conv_dtype"),
            _dtype_bytes(ssm_dtype, "ssm_dtype"))


def _attention_segments(
    total_kv_heads: int, head_dim: int, block_tokens: int, dtype_bytes: int, tp_size: int
) -> tuple[int, int]:
    """(heads_local, bytes of one of K or V in one kernel block)."""
    heads = _local_units(total_kv_heads, tp_size, "total_kv_heads")
    return heads, heads * block_tokens * head_dim * dtype_bytes


def attention_layout(
    *,
    model: str,
    num_layers: int,
    total_kv_heads: int,
    head_dim: int,
    block_tokens: int,
    tp_size: int,
    num_blocks: int,
    dtype: str = "bfloat16",
    kv_separate: bool = False,
) -> Layout:
    """Pure attention. Blocks-first K|V in one page per layer, or (``kv_separate``)
    K and V as separate regions (even regions K, odd regions V).

    ``total_kv_heads < tp_size`` replicates heads: neighbouring ranks share one.
    """
    _positive(num_layers=num_layers, total_kv_heads=total_kv_heads, head_dim=head_dim,
              block_tokens=block_tokens, num_blocks=num_blocks)
    _check_tp_rank(tp_size)
    db = _dtype_bytes(dtype, "dtype")
    _, kv = _attention_segments(total_kv_heads, head_dim, block_tokens, db, tp_size)
    if kv_separate:
        segs = (
            Segment("k", 0, kv, total_kv_heads, regions=tuple(range(0, 2 * num_layers, 2))),
            Segment("v", 0, kv, total_kv_heads, regions=tuple(range(1, 2 * num_layers, 2))),
        )
        regions, kb = 2 * num_layers, kv
    else:
        segs = (Segment("k", 0, kv, total_kv_heads), Segment("v", kv, kv, total_kv_heads))
        regions, kb = num_layers, 2 * kv
    group = Group("attention", segs, 1, kb, block_tokens)
    facts: dict[str, str | int] = {
        "name": model, "dtype": dtype, "num_layers": num_layers,
        "total_kv_heads": total_kv_heads, "head_dim": head_dim,
        "kv_separate": int(kv_separate),
    }
    return validate(Layout("attention", tp_size, regions, num_blocks, kb, (group,), facts))


def mla_layout(
    *,
    model: str,
    num_layers: int,
    latent_dim: int,
    block_tokens: int,
    tp_size: int,
    num_blocks: int,
    dtype: str = "bfloat16",
) -> Layout:
    """Multi-head latent attention: every rank holds the same latent entry, so
    any one P rank can serve a D rank."""
    _positive(num_layers=num_layers, latent_dim=latent_dim, block_tokens=block_tokens,
              num_blocks=num_blocks)
    _check_tp_rank(tp_size)
    db = _dtype_bytes(dtype, "dtype")
    nbytes = block_tokens * latent_dim * db
    group = Group("attention", (Segment("latent", 0, nbytes, 1, "replicated"),), 1, nbytes,
                  block_tokens)
    facts: dict[str, str | int] = {
        "name": model, "dtype": dtype, "num_layers": num_layers, "latent_dim": latent_dim,
    }
    return validate(Layout("mla", tp_size, num_layers, num_blocks, nbytes, (group,), facts))


def _hybrid(
    *,
    family: str,
    facts: dict[str, str | int],
    num_layers: int,
    total_kv_heads: int,
    head_dim: int,
    block_tokens: int,
    kv_dtype: str,
    tp_size: int,
    num_blocks: int,
    conv: list[tuple[str, int, int]],  # (name, units_total, unit_bytes)
    temporal: tuple[int, int],  # (units_total, unit_bytes)
    group_order: tuple[GroupKind, ...],
) -> Layout:
    """Assemble a hybrid (or pure-Mamba, ``total_kv_heads == 0``) layout.

    The page is sized like vLLM's hybrid manager: the attention page is a whole
    number of kernel blocks large enough to hold the Mamba state,
    ``sub_blocks = ceil(mamba_state / kernel_block)``, which is why P and D
    with different tp have different ``sub_blocks``.
    """
    segs: list[Segment] = []
    off = 0
    for name, total, ub in [*conv, ("ssm", *temporal)]:
        n = _local_units(total, tp_size, f"{name} units") if total else 0
        if n == 0:
            continue
        segs.append(Segment(name, off, n * ub, total))
        off += n * ub
    mamba_bytes = off
    mamba = Group("mamba", tuple(segs))
    groups: dict[GroupKind, Group] = {"mamba": mamba}
    if total_kv_heads:
        _positive(head_dim=head_dim, block_tokens=block_tokens)
        db = _dtype_bytes(kv_dtype, "kv_dtype")
        _, kv = _attention_segments(total_kv_heads, head_dim, block_tokens, db, tp_size)
        kb = 2 * kv
        sub = max(1, math.ceil(mamba_bytes / kb))
        groups["attention"] = Group(
            "attention",
            (Segment("k", 0, kv, total_kv_heads), Segment("v", kv, kv, total_kv_heads)),
            sub, kb, block_tokens,
        )
        page = sub * kb
        facts = {**facts, "total_kv_heads": total_kv_heads, "head_dim": head_dim,
                 "kv_dtype": kv_dtype}
    else:
        page = mamba_bytes
        group_order = ("mamba",)
    ordered = tuple(groups[k] for k in group_order if k in groups)
    return validate(Layout(family, tp_size, num_layers, num_blocks, page, ordered, facts))


def mamba2_hybrid_layout(
    *,
    model: str,
    num_layers: int,
    total_kv_heads: int,
    head_dim: int,
    block_tokens: int,
    intermediate_size: int,
    n_groups: int,
    d_state: int,
    conv_kernel: int,
    mamba_heads: int,
    mamba_head_dim: int,
    tp_size: int,
    num_blocks: int,
    kv_dtype: str = "bfloat16",
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
    group_order: tuple[GroupKind, ...] = ("attention", "mamba"),
) -> Layout:
    """Attention + Mamba2 (Nemotron-H style), DS conv layout ``x | B | C``.

    x is split per channel, B and C per group of ``d_state`` channels (fewer
    groups than ranks replicate them), the temporal state per head.
    """
    _positive(num_layers=num_layers, intermediate_size=intermediate_size, n_groups=n_groups,
              d_state=d_state, mamba_heads=mamba_heads, mamba_head_dim=mamba_head_dim,
              num_blocks=num_blocks)
    _check_tp_rank(tp_size)
    if mamba_heads * mamba_head_dim != intermediate_size:
        raise LayoutError(
            f"mamba_heads * mamba_head_dim ({mamba_heads} * {mamba_head_dim}) must equal "
            f"intermediate_size ({intermediate_size})"
        )
    rows, cb, sb = _state_params(conv_kernel, conv_dtype, ssm_dtype)
    facts: dict[str, str | int] = {
        "name": model, "num_layers": num_layers, "intermediate_size": intermediate_size,
        "n_groups": n_groups, "d_state": d_state, "conv_kernel": conv_kernel,
        "mamba_heads": mamba_heads, "mamba_head_dim": mamba_head_dim,
        "conv_dtype": conv_dtype, "ssm_dtype": ssm_dtype,
    }
    return _hybrid(
        family="mamba2", facts=facts, num_layers=num_layers, total_kv_heads=total_kv_heads,
        head_dim=head_dim, block_tokens=block_tokens, kv_dtype=kv_dtype, tp_size=tp_size,
        num_blocks=num_blocks,
        conv=[("x", intermediate_size, rows * cb), ("B", n_groups, d_state * rows * cb),
              ("C", n_groups, d_state * rows * cb)],
        temporal=(mamba_heads, mamba_head_dim * d_state * sb),
        group_order=group_order,
    )


def gdn_hybrid_layout(
    *,
    model: str,
    num_layers: int,
    total_kv_heads: int,
    head_dim: int,
    block_tokens: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    tp_size: int,
    num_blocks: int,
    kv_dtype: str = "bfloat16",
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
    group_order: tuple[GroupKind, ...] = ("attention", "mamba"),
) -> Layout:
    """Attention + gated delta net (Qwen3-Next style), conv ``Q | K | V`` per
    channel, temporal state ``[v_heads][head_k_dim][head_v_dim]``."""
    _positive(num_layers=num_layers, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
              head_k_dim=head_k_dim, head_v_dim=head_v_dim, num_blocks=num_blocks)
    _check_tp_rank(tp_size)
    _local_units(num_k_heads, tp_size, "num_k_heads")
    _local_units(num_v_heads, tp_size, "num_v_heads")
    rows, cb, sb = _state_params(conv_kernel, conv_dtype, ssm_dtype)
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    facts: dict[str, str | int] = {
        "name": model, "num_layers": num_layers, "num_k_heads": num_k_heads,
        "num_v_heads": num_v_heads, "head_k_dim": head_k_dim, "head_v_dim": head_v_dim,
        "conv_kernel": conv_kernel, "conv_dtype": conv_dtype, "ssm_dtype": ssm_dtype,
    }
    return _hybrid(
        family="gdn", facts=facts, num_layers=num_layers, total_kv_heads=total_kv_heads,
        head_dim=head_dim, block_tokens=block_tokens, kv_dtype=kv_dtype, tp_size=tp_size,
        num_blocks=num_blocks,
        conv=[("Q", key_dim, rows * cb), ("K", key_dim, rows * cb),
              ("V", value_dim, rows * cb)],
        temporal=(num_v_heads, head_k_dim * head_v_dim * sb),
        group_order=group_order,
    )


def mamba1_layout(
    *,
    model: str,
    num_layers: int,
    intermediate_size: int,
    d_state: int,
    conv_kernel: int,
    tp_size: int,
    num_blocks: int,
    total_kv_heads: int = 0,
    head_dim: int = 0,
    block_tokens: int = 0,
    kv_dtype: str = "bfloat16",
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
    group_order: tuple[GroupKind, ...] = ("attention", "mamba"),
) -> Layout:
    """Mamba1 (conv ``x`` only, temporal ``[channels][d_state]``), pure or with
    attention layers (Jamba style) when ``total_kv_heads`` > 0."""
    _positive(num_layers=num_layers, intermediate_size=intermediate_size, d_state=d_state,
              num_blocks=num_blocks)
    _check_tp_rank(tp_size)
    rows, cb, sb = _state_params(conv_kernel, conv_dtype, ssm_dtype)
    facts: dict[str, str | int] = {
        "name": model, "num_layers": num_layers, "intermediate_size": intermediate_size,
        "d_state": d_state, "conv_kernel": conv_kernel, "conv_dtype": conv_dtype,
        "ssm_dtype": ssm_dtype,
    }
    return _hybrid(
        family="mamba1", facts=facts, num_layers=num_layers, total_kv_heads=total_kv_heads,
        head_dim=head_dim, block_tokens=block_tokens, kv_dtype=kv_dtype, tp_size=tp_size,
        num_blocks=num_blocks,
        conv=[("x", intermediate_size, rows * cb)],
        temporal=(intermediate_size, d_state * sb),
        group_order=group_order,
    )


def nemotron_h_like(tp_size: int, num_blocks: int, num_layers: int = 2) -> Layout:
    """Nemotron-3-Nano-30B-A3B shapes (fp8 KV, float32 SSM state): the model
    behind vLLM's "261 kernel blocks per page at TP 1 and 2, 131 at TP 4"."""
    return mamba2_hybrid_layout(
        model="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8", num_layers=num_layers,
        total_kv_heads=2, head_dim=128, block_tokens=16, intermediate_size=4096,
        n_groups=8, d_state=128, conv_kernel=4, mamba_heads=64, mamba_head_dim=64,
        tp_size=tp_size, num_blocks=num_blocks, kv_dtype="fp8", conv_dtype="bfloat16",
        ssm_dtype="float32",
    )
