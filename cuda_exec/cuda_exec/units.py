"""Units and saved-tensor ownership, shared by the profiler and the executor.

Both cut the model into the same units with :class:`UnitTracker`, so a plan made from a profile
applies unit by unit to the executor's step.

Units
-----
A *unit* is one invocation of a unit module. By default the unit modules are the leaf modules
(modules without children); :func:`discover_units` also accepts module classes and/or instances to
use as coarser units, whose submodules are then not units (leaves outside them still are). A module
called twice in one forward (torchvision's ``BasicBlock.relu``) gives two units. Units are numbered
0, 1, ... in forward execution order. A unit module called while another unit runs is part of the
outer unit.

Segments and the glue rule
--------------------------
Code that runs between unit modules ("glue": ``torch.cat``, ``out += identity``, ``x.view(...)``,
``q @ k.transpose(-2, -1)``, ``F.softmax``...) belongs to the most recently finished unit: unit
``i``'s *segment* is its module call plus the glue after it, up to the start of unit ``i + 1``
(or the end of the forward). Tensors produced and saved in a segment belong to its unit, and the
backward of the glue counts as that unit's backward stage. The tracker sees glue through a
``TorchFunctionMode`` and can record it (``keep_replay_info=True``) so the executor can replay a
whole segment when it recomputes a unit. Glue before the first unit belongs to no unit
(``NO_OWNER``); what it produces is never moved.

Ownership
---------
A *value* is one version of one storage: ``(untyped_storage().data_ptr(), tensor._version)``,
checked against a weak reference to the storage so a reused address is not confused with a dead
storage. A saved tensor belongs to the unit that produced its current version:

* outputs of a unit (and inputs it modified in place, such as ``ReLU(inplace=True)``) belong to
  it; an output that is an unmodified input or a view of one (``Flatten``, ``Identity``) keeps its
  producer;
* outputs of glue belong to the segment's unit;
* a tensor saved but never seen before (created inside an op or a module, such as a dropout mask or
  BatchNorm's saved mean) belongs to the unit whose segment saves it;
* model inputs are owned by ``model_input_owner(position)`` (flattened ``(args, kwargs)`` order);
* parameters and buffers (anything sharing their storage) are never activations and get no owner.

Views share the base storage: ownership, byte counts and moves are per storage (counted once), and
every saved tensor keeps its view metadata (size, stride, storage offset, dtype) so the exact view
can be rebuilt.

Per unit the tracker records (:class:`UnitRecord`): its inputs (producer units of the tensors its
module and its glue read, model inputs by position), output bytes, the bytes of the saved tensors
it owns, whether its output is among them, ``read_by`` (units whose backward reads its saved
tensors), ``held_input_bytes`` (its inputs that nobody saves; ``held_from`` splits off the part
produced by earlier units, per producer) and ``saved_inputs`` (the input units
a value of which it reads is saved: a replay gets that value from the producer's activations, so a
recomputed producer is replayed first). One tracker context covers one forward.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode

__all__ = [
    "NO_OWNER",
    "model_input_owner",
    "model_input_position",
    "discover_units",
    "unit_kind",
    "ViewMeta",
    "ValueRec",
    "InputRef",
    "PackInfo",
    "GlueCall",
    "Segment",
    "UnitRecord",
    "UnitTracker",
    "CallRecord",
    "sequence_mismatch",
    "storage_bytes",
    "replaying",
    "is_replaying",
    "enter_replay",
    "leave_replay",
]

#: Owner of tensors produced before the first unit (and of untracked tensors).
NO_OWNER = -1

UnitSpec = Union[type, nn.Module]


def model_input_owner(position: int) -> int:
    """The owner code of the model input at flattened position ``position`` (always < -1)."""
    return -2 - position


def model_input_position(owner: int) -> Optional[int]:
    """The model-input position encoded in ``owner``, or None if it is not a model input."""
    return -2 - owner if owner <= -2 else None


# --------------------------------------------------------------------------------------------
# Unit discovery
# --------------------------------------------------------------------------------------------


def discover_units(model: nn.Module, units: Optional[Iterable[UnitSpec]] = None) -> Dict[nn.Module, str]:
    """The unit modules of ``model`` and their qualified names, in registration order.

    ``units=None``: every leaf module (a module without children; the model itself if it has none).
    Otherwise ``units`` lists module classes and/or instances used as coarse units: every outermost
    module matching one of them is a unit, its submodules are not, and leaves outside any match
    remain units.
    """
    classes = tuple(u for u in (units or ()) if isinstance(u, type))
    instances = {id(u) for u in (units or ()) if isinstance(u, nn.Module)}

    def matches(m: nn.Module) -> bool:
        return id(m) in instances or (bool(classes) and isinstance(m, classes))

    found: Dict[nn.Module, str] = {}

    def walk(m: nn.Module, name: str) -> None:
        if m in found:
            return
        children = list(m.named_children())
        if matches(m) or not children:
            found[m] = name or "(root)"
            return
        for child_name, child in children:
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(model, "")
    return found


_KINDS: Sequence[Tuple[str, str]] = (
    ("Conv", "conv"),
    ("Linear", "linear"),
    ("Bilinear", "linear"),
    ("Norm", "norm"),
    ("MultiheadAttention", "attention"),
    ("Attention", "attention"),
    ("Dropout", "dropout"),
    ("Embedding", "embedding"),
    ("Pool", "pool"),
    ("ReLU", "activation"),
    ("GELU", "activation"),
    ("SiLU", "activation"),
    ("Sigmoid", "activation"),
    ("Tanh", "activation"),
    ("Softmax", "activation"),
    ("Hardswish", "activation"),
    ("Hardtanh", "activation"),
    ("Mish", "activation"),
    ("ELU", "activation"),
    ("Softplus", "activation"),
    ("Flatten", "reshape"),
    ("Unflatten", "reshape"),
    ("Identity", "identity"),
    ("LSTM", "rnn"),
    ("GRU", "rnn"),
    ("RNN", "rnn"),
)


def unit_kind(module: nn.Module) -> str:
    """A coarse kind for the Profile format (``conv``, ``linear``, ``norm``, ``activation``, ...)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn"):
            name = cls.__name__
            for needle, kind in _KINDS:
                if needle in name:
                    return kind
    name = type(module).__name__
    for needle, kind in _KINDS:
        if needle in name:
            return kind
    return "other"


def sequence_mismatch(
    expected: Sequence[Tuple[str, str]], actual: Sequence[Tuple[str, str]]
) -> Optional[str]:
    """Compare two steps' unit sequences of ``(name, kind)``; None if equal, else a message.

    Data-dependent control flow shows up as a different sequence."""
    for i, (a, b) in enumerate(zip(expected, actual)):
        if tuple(a) != tuple(b):
            return f"unit {i}: expected {tuple(a)}, got {tuple(b)}"
    if len(expected) != len(actual):
        return f"expected {len(expected)} units, got {len(actual)}"
    return None


# --------------------------------------------------------------------------------------------
# Plain records
# --------------------------------------------------------------------------------------------


class ViewMeta:
    """What is needed to rebuild a tensor as a view of its (moved or rebuilt) storage; hashable,
    never changed once made. A class with slots, not a frozen dataclass, which takes twice as long
    to make: one is made at every saved tensor the executor swaps or drops."""

    __slots__ = ("size", "stride", "offset", "dtype", "_dense", "_shape")

    def __init__(self, size: Tuple[int, ...], stride: Tuple[int, ...], offset: int, dtype: torch.dtype) -> None:
        self.size = size
        self.stride = stride
        self.offset = offset
        self.dtype = dtype
        self._dense = -1  #: dense_bytes(), once asked (a cache: not part of what the view is)
        self._shape: Any = _UNASKED  #: shape_key(), once asked (a cache too)

    def _key(self) -> Tuple[Any, ...]:
        return (self.size, self.stride, self.offset, self.dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ViewMeta) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"ViewMeta(size={self.size}, stride={self.stride}, offset={self.offset}, dtype={self.dtype})"

    @staticmethod
    def of(t: torch.Tensor) -> "ViewMeta":
        return ViewMeta(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def describes(self, t: torch.Tensor) -> bool:
        """``t`` is this view (of some storage): what ``of(t)`` would make, without making it."""
        return (t.dtype is self.dtype and t.storage_offset() == self.offset and t.shape == self.size
                and t.stride() == self.stride)

    def view_of(self, storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
        """A tensor with this metadata over ``storage``."""
        return empty_tensor(self.dtype, device).set_(storage, self.offset, self.size, self.stride)

    def dense_bytes(self) -> int:
        """Bytes of the storage ``torch.empty_strided(size, stride)`` makes: where a storage of
        this many bytes holds the view at offset 0, a new one comes from that call (half of what
        a new storage and :meth:`view_of` take)."""
        d = self._dense
        if d < 0:
            d = 0 if 0 in self.size else (1 + sum((n - 1) * s for n, s in zip(self.size, self.stride)))
            d = self._dense = d * self.dtype.itemsize
        return d

    def shape_key(self) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
        """``(dtype, size)`` where this view is a whole contiguous tensor (offset 0, the strides of
        ``torch.empty(size)``, at least one element) of a dtype other than ``uint8``; else None.
        A copy of such a tensor can be kept as a tensor of that shape (the CPU backend's host
        copies: its ``clone()`` is the copy back)."""
        k = self._shape
        if k is _UNASKED:
            k = None
            if self.offset == 0 and self.dtype is not torch.uint8 and 0 not in self.size:
                expect = 1
                for n, s in zip(reversed(self.size), reversed(self.stride)):
                    if s != expect:
                        break
                    expect *= n
                else:
                    k = (self.dtype, self.size)
            self._shape = k
        return k


#: ``ViewMeta._shape`` before ``shape_key()`` was asked
_UNASKED: Any = object()


#: an empty tensor per (dtype, device), whose ``new()`` makes another
_EMPTY: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_tensor(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new tensor of no elements, to ``set_`` a storage into: ``Tensor.new()`` of a kept one,
    a third faster than ``torch.empty(0, ...)`` (swaps make one per saved storage and per unpack)."""
    t = _EMPTY.get((dtype, device))
    if t is None:
        t = _EMPTY[(dtype, device)] = torch.empty(0, dtype=dtype, device=device)
    return t.new()


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (what keeping ``t`` alive costs)."""
    return t.untyped_storage().nbytes()


class ValueRec:
    """One version of one storage seen during the forward."""

    __slots__ = ("owner", "nbytes", "saved", "readers", "storage_id", "__weakref__")

    def __init__(self, owner: int, nbytes: int, storage_id: int) -> None:
        self.owner = owner  #: unit index, NO_OWNER, or model_input_owner(position)
        self.nbytes = nbytes  #: bytes of the whole storage
        self.saved = False  #: packed by autograd at least once
        self.readers: Set[int] = set()  #: units whose backward reads it
        self.storage_id = storage_id  #: distinguishes storages (for counting bytes once)


class _StorageRec:
    __slots__ = ("ref", "nbytes", "versions", "sid")

    def __init__(self, storage: torch.UntypedStorage, sid: int) -> None:
        self.ref = StorageWeakRef(storage)
        self.nbytes = storage.nbytes()
        self.versions: Dict[int, ValueRec] = {}
        self.sid = sid


@dataclass
class InputRef:
    """A tensor a segment reads that it did not produce (an input of the unit)."""

    value: ValueRec
    meta: ViewMeta
    device: torch.device
    #: free for the executor: how it gets this input back when it replays the segment
    slot: Any = None


@dataclass
class PackInfo:
    """What the tracker knows about a tensor autograd is saving."""

    kind: str  #: "activation", "param" (parameter or buffer), or "untracked"
    owner: int  #: owning unit, NO_OWNER, or a model-input code
    reader: int  #: unit whose segment saves it (its backward reads it); NO_OWNER before any unit
    value: Optional[ValueRec]
    meta: Optional[ViewMeta]
    #: index of this pack among all packs of the reader's segment (-1 outside segments)
    seg_pack: int = -1
    #: the owner's segment is the one saving it (the replay of that segment regenerates it in order)
    in_owner_segment: bool = False


def replay_start_state(module: nn.Module, written: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Of the buffers (or parameters) ``written`` that ``module``'s forward writes into, those a
    replay must see as its forward did (kept from the forward, put in place before the replay):
    all but the running statistics of normalization layers in training mode, which their forward
    writes and never reads. An EMA the forward updates and then uses, spectral_norm's
    power-iteration vectors, or a buffer a unit reads that a later unit updates, replayed from
    their updated values, would regenerate other tensors than the forward saved."""
    norm = {id(b) for m in module.modules() if isinstance(m, _NormBase) and m.training
            for b in m.buffers(recurse=False)}
    return [b for b in written if id(b) not in norm]


def _kept(packed: Any, t: torch.Tensor) -> Any:
    """What autograd keeps when a pack hook keeps the tensor itself: ``t`` detached. A saved
    output arrives with the node that saves it as its ``grad_fn``; kept as it is, node and tensor
    keep each other alive (a cycle through C++ that Python's collector cannot see) wherever the
    backward does not release them: a graph the forward lets go of (a detached branch), a forward
    without backward, ``backward(retain_graph=True)``. Detached, autograd gives the grad_fn back at
    unpack (torch's own hooks detach for this reason)."""
    return t.detach() if packed is t else packed


class _WatchedPack:
    """What autograd keeps for a saved tensor while a tracker watches whether its graph outlives
    the forward (``UnitTracker(watch_packs=True)``): the packed object, and a weak reference's
    target."""

    __slots__ = ("packed", "__weakref__")

    def __init__(self, packed: Any) -> None:
        self.packed = packed


@dataclass
class GlueCall:
    """One torch call made by glue code, with tensors replaced by references (see Segment)."""

    func: Callable[..., Any]
    leaves: List[Tuple[str, Any]]
    spec: Any
    out_values: List[Tuple[int, int]]  #: (position in flattened output, segment value index)
    mutated: List[Tuple[int, int]]  #: (position in flattened (args, kwargs), segment value index)
    grad_enabled: bool
    #: the tracker's event count when the call ran (UnitTracker.events: module calls and glue
    #: calls in the order of the forward), which places it inside or outside module calls
    event: int = -1
    #: the values (versions) of its tensor outputs and of the inputs it wrote into
    produced: List["ValueRec"] = field(default_factory=list)


@dataclass
class Segment:
    """A unit's module call plus the glue after it.

    Tensor references in ``arg_leaves`` and ``GlueCall.leaves`` are ``("lit", obj)`` for a
    non-tensor, ``("const", tensor)`` for a parameter, buffer or tensor unknown to this step (used
    as it is), ``("in", i)`` for ``inputs[i]`` and ``("seg", j)`` for the ``j``-th tensor produced in
    the segment."""

    unit: int
    module: nn.Module
    inputs: List[InputRef] = field(default_factory=list)
    arg_leaves: List[Tuple[str, Any]] = field(default_factory=list)
    arg_spec: Any = None
    #: (position in the module's flattened output, segment value index)
    out_values: List[Tuple[int, int]] = field(default_factory=list)
    calls: List[GlueCall] = field(default_factory=list)
    #: per segment value: the values (versions) it had that this unit owns
    value_keys: List[List[ValueRec]] = field(default_factory=list)
    #: every value in ``value_keys``
    owned_values: Set[ValueRec] = field(default_factory=set)
    #: parameters/buffers that glue of this segment wrote into (the replay must restore them)
    mutated_params: List[torch.Tensor] = field(default_factory=list)
    #: per pack made in this segment: (owned by this unit, view metadata)
    packs: List[Tuple[bool, Optional[ViewMeta]]] = field(default_factory=list)
    #: free for the executor
    runtime: Any = None


@dataclass
class UnitRecord:
    """Plain data about one unit, for the Profile format."""

    index: int
    name: str  #: qualified module name, ``#k`` appended for the k-th (k >= 1) call of a module
    module_name: str
    kind: str
    call: int  #: 0 for the module's first call in the step, 1 for the second, ...
    inputs: List[int] = field(default_factory=list)
    model_inputs: List[int] = field(default_factory=list)
    output_bytes: int = 0  #: storages of outputs whose current version this unit produced
    act_bytes: int = 0  #: storages of saved tensors this unit owns, each counted once
    output_saved: bool = False
    read_by: List[int] = field(default_factory=list)
    held_input_bytes: int = 0
    #: input units some of whose values this unit reads are saved (among their activations): a
    #: replay of this unit gets those values from the producers' activations, not from held inputs
    saved_inputs: List[int] = field(default_factory=list)
    #: the part of held_input_bytes produced by earlier units: [(producer, bytes)], producers ascending
    held_from: List[Tuple[int, int]] = field(default_factory=list)
    #: bytes of the saved values it reads from earlier units: [(producer, bytes)], ascending
    saved_from: List[Tuple[int, int]] = field(default_factory=list)
    #: held_from and saved_from one value (storage) at a time: [(producer, value id, bytes)], the
    #: id the same wherever the value is read, so that readers of one value can count it once
    held_values: List[Tuple[int, int, int]] = field(default_factory=list)
    saved_values: List[Tuple[int, int, int]] = field(default_factory=list)
    inplace: bool = False  #: its output is an input it modified in place
    saved_tensors: int = 0  #: packs of tensors it owns (a storage packed twice counts twice)
    #: its segment drew random numbers (``UnitTracker(track_random=True)``; a checkpoint segment
    #: containing it keeps the generators' state for its replay)
    random: bool = False
    act_storages: int = 0  #: storages of the saved tensors it owns
    packs: int = 0  #: saved tensors its segment makes (of any owner)


class CallRecord:
    """One module call of a forward (``UnitTracker(record_calls=True)``: every module of the
    model): where it starts and ends among the tracker's events (module calls and glue calls, in
    order), the packs and unit starts before each end, what values its tensor arguments and
    outputs were, and which buffers a unit's call wrote into."""

    __slots__ = ("module", "parent", "enter", "exit", "pack_enter", "pack_exit", "units_enter", "units_exit",
                 "arg_values", "arg_tensor", "arg_versions", "arg_written", "arg_views", "simple", "out_values",
                 "out_views", "buffers", "mutated_buffers", "unit", "arg_ids", "out_ids")

    def __init__(self, module: nn.Module, parent: int, enter: int, pack: int, units: int,
                 arg_values: List[Optional["ValueRec"]]) -> None:
        self.module = module
        self.parent = parent  #: the enclosing call (index in UnitTracker.calls), -1 at the top
        self.enter = enter
        self.exit = -1
        self.pack_enter = pack
        self.pack_exit = -1
        self.units_enter = units  #: units started before it
        self.units_exit = -1  #: units started before it returned
        #: per leaf of its flattened (args, kwargs): the value of a tensor leaf (None: not a
        #: tensor, or unknown to the step)
        self.arg_values = arg_values
        self.arg_tensor: List[bool] = []  #: per leaf: a tensor
        self.simple = False  #: called with positional tensors only
        self.arg_versions: List[int] = []
        #: per leaf: the call wrote into that tensor argument in place
        self.arg_written: List[bool] = []
        #: per leaf: the tensor argument's view of its storage (values are storage versions, so a
        #: view of another call's output has that output's value: its view tells them apart)
        self.arg_views: List[Optional[ViewMeta]] = []
        self.out_values: List[Optional["ValueRec"]] = []
        self.out_views: List[Optional[ViewMeta]] = []
        #: id() of each tensor leaf of its arguments and of its output (None: not a tensor); only
        #: compared between calls whose tensors are alive at once (program.py: chained units)
        self.arg_ids: List[Optional[int]] = []
        self.out_ids: List[Optional[int]] = []
        self.buffers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.mutated_buffers: List[torch.Tensor] = []
        self.unit = -1  #: the unit this call starts, -1 when it starts none


# --------------------------------------------------------------------------------------------
# The tracker
# --------------------------------------------------------------------------------------------

_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
}


def _written_ids(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Set[int]:
    """ids of the tensor arguments a torch call is about to write into, guessed from its name
    (``x.add_(y)``, ``x += y``, ``x[i] = y`` write ``x``; ``out=`` is written). Writes are also
    detected after the call through version counters."""
    ids: Set[int] = set()
    name = getattr(func, "__name__", "")
    if (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))) and args:
        if isinstance(args[0], torch.Tensor):
            ids.add(id(args[0]))
    out = kwargs.get("out")
    if out is not None:
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                ids.add(id(leaf))
    return ids


def _is_plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


_TLS = threading.local()


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """While active (in this thread), trackers ignore everything: the executor replays a segment."""
    _TLS.depth = getattr(_TLS, "depth", 0) + 1
    try:
        yield
    finally:
        _TLS.depth -= 1


def is_replaying() -> bool:
    return getattr(_TLS, "depth", 0) > 0


def enter_replay() -> None:
    """:func:`replaying` without a context manager (pair it with :func:`leave_replay`)."""
    _TLS.depth = getattr(_TLS, "depth", 0) + 1


def leave_replay() -> None:
    _TLS.depth -= 1


class _GlueMode(TorchFunctionMode):
    def __init__(self, tracker: "UnitTracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        tr = self.tracker
        if tr._depth > 0 or tr._busy > 0 or not tr._active or is_replaying():
            return func(*args, **kwargs)
        return tr._glue_call(func, args, kwargs)


class UnitTracker:
    """Cut one forward into units and track saved-tensor ownership.

    ``with UnitTracker(model) as tr: out = model(x)`` installs forward pre/post hooks on the unit
    modules, a forward pre-hook on ``model`` (to learn the model inputs), a saved-tensor
    pack/unpack pair and a TorchFunctionMode for glue; leaving the context always removes all of
    them (also on exceptions) and fills :attr:`records`.

    Subclasses (the executor) customise :meth:`on_unit_start`, :meth:`on_unit_end`,
    :meth:`on_input`, :meth:`on_pack`, :meth:`on_unpack` and :meth:`on_value_saved`.
    ``keep_replay_info=True`` records what replaying a segment needs (argument structure, glue
    calls, pack order), holding references to parameters and constants only.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Optional[Iterable[UnitSpec]] = None,
        *,
        keep_replay_info: bool = False,
        unit_modules: Optional[Dict[nn.Module, str]] = None,
        track_random: bool = False,
        record_calls: bool = False,
        watch_packs: bool = False,
    ) -> None:
        self.model = model
        #: count as activations only the saved tensors whose graph is still alive when the forward
        #: returns (a detached branch's graph goes in the forward): autograd keeps a watched
        #: wrapper of each pack (the profiler's structure step; its ``on_pack`` returns the tensor)
        self.watch_packs = watch_packs
        self._watched: List[Tuple[int, int, ValueRec, "weakref.ReferenceType[_WatchedPack]"]] = []
        #: record every module call (CallRecord) and per unit its call: ``calls``, ``unit_call``;
        #: ``glue_scopes()`` then says which module call encloses each unit's glue
        self.record_calls = record_calls
        self.calls: List[CallRecord] = []
        self.unit_call: List[int] = []
        self._call_stack: List[int] = []
        self._call_args: List[List[Any]] = []
        #: packs seen (while active, outside the tracker's own work and replays)
        self.pack_count = 0
        #: (event, unit) of every glue call with tensor outputs or in-place writes
        self.glue_events: List[Tuple[int, int]] = []
        #: compare the random-number generators' states at every unit start (UnitRecord.random)
        self.track_random = track_random
        #: glue calls with tensor outputs (or in-place writes) so far, and whatever a subclass
        #: counts with them (the executor's learning step: module calls): an order of events
        self.events = 0
        self._rng_at_start: Optional[List[torch.Tensor]] = None
        self.unit_modules: Dict[nn.Module, str] = (
            unit_modules if unit_modules is not None else discover_units(model, units)
        )
        self.keep_replay_info = keep_replay_info
        #: one record per unit seen so far; complete after the context exits without error
        self.records: List[UnitRecord] = []
        self.segments: List[Segment] = []
        #: after the forward: storage id -> value id of the values units read (held_values ids)
        self.value_ids: Dict[int, int] = {}
        self.model_input_bytes = 0
        self._handles: List[Any] = []
        self._hooks_ctx: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._mode: Optional[_GlueMode] = None
        self._active = False
        self._finished = False
        self._busy = 0
        self._depth = 0
        self._current: Optional[int] = None
        self._last: int = NO_OWNER
        self._calls: Dict[nn.Module, int] = {}
        self._storages: Dict[int, _StorageRec] = {}
        self._next_sid = 0
        self._param_ptrs: Set[int] = set()
        #: data pointers of parameters that come to the device during the forward (a set another
        #: object keeps up to date; state_swap.py), counted as parameters too
        self.param_ptrs_extra: Optional[Set[int]] = None
        self._seg_ids: Dict[int, Tuple[Any, int]] = {}
        self._frames: List[Tuple[int, List[Tuple[torch.Tensor, int, Optional[int]]]]] = []
        # per unit accounting
        self._out_values: Dict[int, List[ValueRec]] = defaultdict(list)
        self._inplace: Dict[int, bool] = defaultdict(bool)
        self._act: Dict[int, Dict[int, int]] = defaultdict(dict)
        self._owned_packs: Dict[int, int] = defaultdict(int)
        self._readers: Dict[int, Set[int]] = defaultdict(set)

    # ---------------------------------------------------------------- context management

    def __enter__(self) -> "UnitTracker":
        if self._active or self._finished:
            raise RuntimeError("a UnitTracker covers exactly one forward; make a new one")
        self._param_ptrs = {
            t.untyped_storage().data_ptr()
            for t in list(self.model.parameters()) + list(self.model.buffers())
            if _is_plain(t)
        }
        try:
            # A unit starts before the module's own forward pre-hooks run (prepend): what they do
            # (spectral_norm's power iteration, weight_norm's weight) is the unit's, as in its
            # replay, which calls the module, hooks and all.
            for module in self.unit_modules:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True))
            if self.record_calls:  # a call starts before the unit hooks (prepend) see it, after the
                for module in self.model.modules():  # model inputs' hook (below) registered them
                    self._handles.append(module.register_forward_pre_hook(self._call_start, with_kwargs=True,
                                                                          prepend=True))
            self._handles.append(
                self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True, prepend=True)
            )
            for module in self.unit_modules:
                self._handles.append(module.register_forward_hook(self._post_hook, with_kwargs=True))
            if self.record_calls:  # a call ends after the unit hooks registered its outputs
                for module in self.model.modules():
                    self._handles.append(module.register_forward_hook(self._call_end))
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
            self._hooks_ctx.__enter__()
            self._mode = _GlueMode(self)
            self._mode.__enter__()
            self._active = True
        except BaseException:
            self._uninstall()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.track_random and exc_type is None:
            self._note_random(len(self.records))
        self._uninstall()
        if exc_type is None:
            if self.watch_packs:
                self._forget_released_packs()
            self._finalize()

    def _uninstall(self) -> None:
        self._active = False
        self._finished = True
        errors: List[BaseException] = []
        if self._mode is not None:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except BaseException as e:  # pragma: no cover - defensive
                errors.append(e)
        if self._hooks_ctx is not None:
            ctx, self._hooks_ctx = self._hooks_ctx, None
            try:
                ctx.__exit__(None, None, None)
            except BaseException as e:  # pragma: no cover - defensive
                errors.append(e)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._frames.clear()
        self._seg_ids.clear()
        if errors:  # pragma: no cover - defensive
            raise errors[0]

    # ---------------------------------------------------------------- what subclasses customise

    def on_unit_start(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Called when unit ``index`` starts (its inputs are already recorded)."""

    def on_unit_end(self, index: int, module: nn.Module, output: Any) -> None:
        """Called when unit ``index``'s module returns."""

    def on_input(self, segment: Segment, ref: InputRef, tensor: torch.Tensor, will_modify: bool) -> None:
        """A segment reads ``tensor`` it did not produce. ``will_modify``: the unit (a module with
        ``inplace=True``) or the glue call (an in-place op) may write into it right now."""

    def on_pack(self, tensor: torch.Tensor, info: PackInfo) -> Any:
        """Autograd saves ``tensor``; return what autograd should keep (default: the tensor)."""
        return tensor

    def on_unpack(self, packed: Any) -> torch.Tensor:
        """Autograd needs a saved tensor back."""
        return packed

    def on_value_saved(self, value: ValueRec, tensor: torch.Tensor, info: PackInfo) -> None:
        """Called the first time a value is saved (before :meth:`on_pack`)."""

    def on_segment_value(self, segment: Segment, index: int, tensor: torch.Tensor) -> None:
        """A segment produced a new tensor object (a unit output or a glue result)."""

    def on_param_write(self, segment: Segment, tensor: torch.Tensor) -> None:
        """A glue call of ``segment`` is about to write into a parameter or buffer."""

    def on_param_read(self, segment: Segment, tensor: torch.Tensor) -> None:
        """``segment``'s unit or glue reads a parameter or buffer."""

    def on_unit_writes(self, index: int, written: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(``record_calls``) Unit ``index``'s module call wrote into its buffers ``written``
        (each with a copy of its value before the call)."""

    def on_input_mutated(self, segment: Segment, ref: InputRef) -> None:
        """The segment's unit or glue wrote into an input it read (after :meth:`on_input`)."""

    # ---------------------------------------------------------------- queries

    @property
    def current_unit(self) -> Optional[int]:
        """The unit whose module is running, or None in glue."""
        return self._current

    @property
    def segment_unit(self) -> int:
        """The unit whose segment is running (the current unit, else the last finished one)."""
        return self._current if self._current is not None else self._last

    def sequence(self) -> List[Tuple[str, str]]:
        """``(name, kind)`` of every unit seen so far, in order."""
        return [(r.name, r.kind) for r in self.records]

    def value_of(self, t: torch.Tensor) -> Optional[ValueRec]:
        """The value record of ``t``'s current version, if this step has seen it."""
        if not _is_plain(t):
            return None
        st = t.untyped_storage()
        rec = self._storages.get(st.data_ptr())
        if rec is None or rec.ref.expired():
            return None
        return rec.versions.get(t._version)

    def is_param(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares storage with a parameter or buffer of the model (also one brought
        back from the host during the forward: ``param_ptrs_extra``)."""
        if not _is_plain(t):
            return False
        ptr = t.untyped_storage().data_ptr()
        return ptr in self._param_ptrs or (self.param_ptrs_extra is not None and ptr in self.param_ptrs_extra)

    # ---------------------------------------------------------------- values

    def _register(self, t: torch.Tensor, owner: int) -> Tuple[ValueRec, bool]:
        """The value of ``t``'s current version, created with ``owner`` if new. Returns (value, new)."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        rec = self._storages.get(ptr)
        if rec is None or rec.ref.expired() or rec.nbytes != st.nbytes():
            rec = _StorageRec(st, self._next_sid)
            self._next_sid += 1
            self._storages[ptr] = rec
        v = t._version
        val = rec.versions.get(v)
        if val is not None:
            return val, False
        val = ValueRec(owner, rec.nbytes, rec.sid)
        rec.versions[v] = val
        return val, True

    def _trackable(self, t: Any) -> bool:
        return _is_plain(t) and t.untyped_storage().nbytes() > 0

    # ---------------------------------------------------------------- segments

    def _add_seg_value(self, seg: Segment, t: torch.Tensor, owned: Optional[ValueRec]) -> int:
        """Index of ``t`` among the segment's values (new if unseen); ``owned``: a value of ``t``
        this unit owns (its current version), recorded so a replay can map it."""
        hit = self._seg_ids.get(id(t))
        if hit is not None and hit[0]() is t:
            j = hit[1]
            new = False
        else:
            j = len(seg.value_keys)
            seg.value_keys.append([])
            self._seg_ids[id(t)] = (weakref.ref(t), j)
            new = True
        if owned is not None and owned not in seg.owned_values:
            seg.value_keys[j].append(owned)
            seg.owned_values.add(owned)
        if new:
            self.on_segment_value(seg, j, t)
        return j

    def _seg_value_index(self, t: torch.Tensor) -> Optional[int]:
        hit = self._seg_ids.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return None

    def _input_value(self, seg: Segment, t: torch.Tensor) -> Optional[ValueRec]:
        """The value of a tensor ``seg`` reads (None: unknown to this step, a constant)."""
        return self.value_of(t)

    def _input_leaf(
        self, seg: Segment, t: torch.Tensor, seen: Dict[int, int], will_modify: bool
    ) -> Tuple[str, Any]:
        """Reference for a tensor a segment reads: const, or an input (recorded once per object)."""
        if not self._trackable(t) or self.is_param(t):
            if self._trackable(t):
                self.on_param_read(seg, t)
            return ("const", t)
        if id(t) in seen:
            return ("in", seen[id(t)])
        val = self._input_value(seg, t)
        if val is None or val.owner == seg.unit:
            return ("const", t)  # unknown to this step: a constant (module attribute, global)
        ref = InputRef(val, ViewMeta.of(t), t.device)
        seg.inputs.append(ref)
        i = len(seg.inputs) - 1
        seen[id(t)] = i
        self.on_input(seg, ref, t, will_modify)
        return ("in", i)

    # ---------------------------------------------------------------- hooks

    def _root_pre_hook(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not self._active or is_replaying():
            return
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            leaves, _ = pytree.tree_flatten((args, kwargs))
            counted: Set[int] = set()
            for pos, leaf in enumerate(leaves):
                if self._trackable(leaf) and not self.is_param(leaf):
                    val, _new = self._register(leaf, model_input_owner(pos))
                    if val.owner == NO_OWNER:  # made by code before the forward, inside the tracker
                        val.owner = model_input_owner(pos)
                    if val.storage_id not in counted:
                        counted.add(val.storage_id)
                        self.model_input_bytes += val.nbytes
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _pre_hook(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not self._active or is_replaying():
            return
        if self._depth > 0:  # a unit module called inside another unit: part of the outer one
            self._depth += 1
            return
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            index = len(self.segments)
            if self.record_calls and self._call_stack:
                c = self._call_stack[-1]  # this module's call (its record is made first)
                self.calls[c].unit = index
                self.unit_call.append(c)
            self._open_unit(index, module, args, kwargs)
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _call_start(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not self._active or is_replaying():
            return
        self._busy += 1  # its own torch calls are not glue
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            leaves = pytree.tree_leaves((args, kwargs))
            rec = CallRecord(module, self._call_stack[-1] if self._call_stack else -1, self.events,
                             self.pack_count, len(self.segments),
                             [self.value_of(x) if isinstance(x, torch.Tensor) else None for x in leaves])
            rec.arg_tensor = [isinstance(x, torch.Tensor) for x in leaves]
            rec.arg_versions = [x._version if isinstance(x, torch.Tensor) else 0 for x in leaves]
            rec.arg_views = [ViewMeta.of(x) if v is not None else None for x, v in zip(leaves, rec.arg_values)]
            rec.arg_ids = [id(x) if isinstance(x, torch.Tensor) else None for x in leaves]
            rec.simple = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
            if module in self.unit_modules and self._depth == 0:
                # a unit's call: which buffers it writes into (BatchNorm's running statistics are
                # written by its kernel without a version bump: compared by content)
                with torch.no_grad():
                    rec.buffers = [(b, b.detach().clone()) for b in module.buffers()]
            self.events += 1
            self._call_args.append(leaves)
            self._call_stack.append(len(self.calls))
            self.calls.append(rec)
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _call_end(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        if not self._active or is_replaying() or not self._call_stack:
            return
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            rec = self.calls[self._call_stack.pop()]
            leaves = self._call_args.pop()
            if rec.module is not module:  # pragma: no cover - a hook of another kind failed in between
                self._call_stack.clear()
                self._call_args.clear()
                return
            rec.exit = self.events
            self.events += 1
            rec.arg_written = [isinstance(x, torch.Tensor) and x._version != v
                               for x, v in zip(leaves, rec.arg_versions)]
            rec.pack_exit = self.pack_count
            rec.units_exit = len(self.segments)
            outs = pytree.tree_leaves(output)
            rec.out_values = [self.value_of(x) if isinstance(x, torch.Tensor) else None for x in outs]
            rec.out_views = [ViewMeta.of(x) if v is not None else None for x, v in zip(outs, rec.out_values)]
            rec.out_ids = [id(x) if isinstance(x, torch.Tensor) else None for x in outs]
            with torch.no_grad():
                written = [(b, before) for b, before in rec.buffers
                           if b.shape != before.shape or not torch.equal(b, before)]
            rec.mutated_buffers = [b for b, _ in written]
            rec.buffers = []
            if written and rec.unit >= 0:
                self.on_unit_writes(rec.unit, written)
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _unit_event(self, u: int) -> int:
        return self.calls[self.unit_call[u]].enter if u < len(self.unit_call) else self.events

    def replayable_call(self, c: int) -> bool:
        """Whether call ``c`` can be replayed for the units it runs: it runs at least one unit and
        no glue (with tensor outputs) before its first unit (that glue belongs to the unit before)."""
        rec = self.calls[c]
        if rec.exit < 0 or rec.units_exit <= rec.units_enter:
            return False
        first = self._unit_event(rec.units_enter)
        i = bisect.bisect_right(self._glue_event_list(), rec.enter)
        events = self._glue_event_list()
        return not (i < len(events) and events[i] < first)

    def _glue_event_list(self) -> List[int]:
        if getattr(self, "_glue_sorted", None) is None or len(self._glue_sorted) != len(self.glue_events):
            self._glue_sorted = [e for e, _ in self.glue_events]
        return self._glue_sorted

    def glue_scopes(self) -> List[Optional[Tuple[int, int]]]:
        """Per unit (``record_calls``): None if its segment runs no glue (with tensor outputs), else
        the units ``(first, last)`` of the innermost replayable module call (``replayable_call``)
        that encloses all of its glue: a checkpoint segment containing those units can be replayed
        by calling that module again. ``(-1, -1)``: no module call does (glue at the model's top
        level, after glue that precedes its first unit)."""
        n = len(self.records)
        out: List[Optional[Tuple[int, int]]] = [None] * n
        # the innermost call enclosing each event: calls are nested, so a stack walk over the
        # calls by their enter order finds it
        by_unit: Dict[int, List[int]] = defaultdict(list)
        for event, unit in self.glue_events:
            if 0 <= unit < n:
                by_unit[unit].append(event)
        if not by_unit:
            return out
        enters = [rec.enter for rec in self.calls]
        for unit, events in by_unit.items():
            scope: Optional[int] = None
            for event in events:
                # innermost call containing the event: the last call entered before it that has
                # not exited yet, found by walking up from the last call entered before it
                c = bisect.bisect_right(enters, event) - 1
                while c >= 0 and not (self.calls[c].enter < event < self.calls[c].exit):
                    c = self.calls[c].parent
                while c >= 0 and not self.replayable_call(c):
                    c = self.calls[c].parent
                if c < 0:
                    scope = -1
                    break
                # the scope must hold every glue call of the unit: the outermost of them
                if scope is None or self.calls[c].enter < self.calls[scope].enter:
                    scope = c
            if scope is None or scope < 0:
                out[unit] = (-1, -1)
            else:
                rec = self.calls[scope]
                out[unit] = (rec.units_enter, rec.units_exit - 1)
        return out

    def _generator_states(self) -> List[torch.Tensor]:
        states = [torch.get_rng_state()]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states += torch.cuda.get_rng_state_all()
        return states

    def _note_random(self, index: int) -> None:
        """At unit ``index``'s start (``index`` = the number of units: the forward's end): did the
        segment of the unit before it draw random numbers?"""
        now = self._generator_states()
        before, self._rng_at_start = self._rng_at_start, now
        if before is not None and 0 < index <= len(self.records) and self.records[index - 1] is not None:
            self.records[index - 1].random = any(
                a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, now)) or len(before) != len(now)

    def _open_unit(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Start unit ``index`` (its module is about to run with ``args``/``kwargs``): record its
        inputs and open its segment. A tracker that sees only some units (the executor's steady
        steps) leaves None in the places of the units it did not see."""
        if self.track_random:
            self._note_random(index)
        call = self._calls.get(module, 0)
        self._calls[module] = call + 1
        qual = self.unit_modules[module]
        name = qual if call == 0 else f"{qual}#{call}"
        rec = UnitRecord(index=index, name=name, module_name=qual, kind=unit_kind(module), call=call)
        seg = Segment(unit=index, module=module)
        if len(self.segments) < index:
            gap = [None] * (index - len(self.segments))
            self.records.extend(gap)  # type: ignore[arg-type]
            self.segments.extend(gap)  # type: ignore[arg-type]
        self.records.append(rec)
        self.segments.append(seg)
        self._seg_ids = {}
        # modules with ``inplace=True`` (ReLU, Dropout, ...) write into their first input
        writes_first = bool(getattr(module, "inplace", False))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        seen: Dict[int, int] = {}
        arg_leaves: List[Tuple[str, Any]] = []
        tensors: List[Tuple[torch.Tensor, int, Optional[int]]] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                ref = self._input_leaf(seg, leaf, seen, writes_first and not tensors)
                arg_leaves.append(ref)
                tensors.append((leaf, leaf._version, ref[1] if ref[0] == "in" else None))
            else:
                arg_leaves.append(("lit", leaf))
        if self.keep_replay_info:
            seg.arg_leaves, seg.arg_spec = arg_leaves, spec
        self._frames.append((index, tensors))
        self._current = index
        self._depth = 1
        self.on_unit_start(index, module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        if not self._active or is_replaying():
            return
        if self._depth > 1:
            self._depth -= 1
            return
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            index, in_tensors = self._frames.pop()
            seg = self.segments[index]
            leaves, _ = pytree.tree_flatten(output)
            in_storages = {t.untyped_storage().data_ptr(): v for t, v, _i in in_tensors
                           if self._trackable(t)}
            for pos, leaf in enumerate(leaves):
                if not self._trackable(leaf):
                    continue
                val, _new = self._register(leaf, index)
                owned = val.owner == index
                if owned:
                    if val not in self._out_values[index]:
                        self._out_values[index].append(val)
                    ptr = leaf.untyped_storage().data_ptr()
                    if ptr in in_storages and in_storages[ptr] != leaf._version:
                        self._inplace[index] = True
                j = self._add_seg_value(seg, leaf, val if owned else None)
                seg.out_values.append((pos, j))
            # inputs written in place but not returned: the new version is this unit's too
            for t, v0, i in in_tensors:
                if self._trackable(t) and t._version != v0:
                    self._register(t, index)
                    if i is not None:
                        self.on_input_mutated(seg, seg.inputs[i])
            self._current = None
            self._depth = 0
            self._last = index
            self.on_unit_end(index, module, output)
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _glue_call(self, func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        unit = self._last
        seg = self.segments[unit] if unit >= 0 else None
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            refs: List[Tuple[str, Any]] = []
            if seg is not None:
                written = _written_ids(func, args, kwargs)
                seen: Dict[int, int] = {}
                for leaf in leaves:
                    if not isinstance(leaf, torch.Tensor):
                        refs.append(("lit", leaf))
                        continue
                    if written and id(leaf) in written and self.is_param(leaf):
                        self.on_param_write(seg, leaf)
                    j = self._seg_value_index(leaf)
                    refs.append(
                        ("seg", j) if j is not None
                        else self._input_leaf(seg, leaf, seen, id(leaf) in written)
                    )
            versions = [leaves[i]._version for i in tensor_pos]
            grad_enabled = torch.is_grad_enabled()
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1
        out = func(*args, **kwargs)
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            out_leaves, _ = pytree.tree_flatten(out)
            has_tensor_out = any(isinstance(x, torch.Tensor) for x in out_leaves)
            mutated_pos = [i for i, v in zip(tensor_pos, versions) if leaves[i]._version != v]
            if not has_tensor_out and not mutated_pos:
                return out
            owner = unit if seg is not None else NO_OWNER
            out_values: List[Tuple[int, int]] = []
            for pos, leaf in enumerate(out_leaves):
                if not self._trackable(leaf) or self.is_param(leaf):
                    continue
                val, _ = self._register(leaf, owner)
                if seg is not None:
                    j = self._add_seg_value(seg, leaf, val if val.owner == unit else None)
                    out_values.append((pos, j))
            mutated: List[Tuple[int, int]] = []
            for pos in mutated_pos:
                t = leaves[pos]
                if seg is not None and self.is_param(t):
                    seg.mutated_params.append(t)
                if not self._trackable(t) or self.is_param(t):
                    continue
                val, _ = self._register(t, owner)
                if seg is not None:
                    if refs[pos][0] == "in":
                        self.on_input_mutated(seg, seg.inputs[refs[pos][1]])
                    j = self._add_seg_value(seg, t, val if val.owner == unit else None)
                    mutated.append((pos, j))
            if seg is not None and self.keep_replay_info:
                produced = [v for v in (self.value_of(x) for x in out_leaves) if v is not None]
                produced += [v for v in (self.value_of(leaves[pos]) for pos in mutated_pos) if v is not None]
                seg.calls.append(GlueCall(func, refs, spec, out_values, mutated, grad_enabled, self.events, produced))
            self.glue_events.append((self.events, unit))
            self.events += 1
            return out
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _pack_owner(self, reader: int) -> int:
        """The owner of a saved tensor never seen before: the unit whose segment saves it."""
        return reader

    def _pack_hook(self, t: torch.Tensor) -> Any:
        if not self._active or self._busy > 0 or is_replaying():
            return t.detach()
        self.pack_count += 1
        self._busy += 1
        no_modes = torch._C.DisableTorchFunction()  # its own tensor calls skip the glue mode
        no_modes.__enter__()
        try:
            reader = self.segment_unit
            seg = self.segments[reader] if reader >= 0 else None
            seg_pack = -1
            if seg is not None:
                seg_pack = len(seg.packs)
            if not self._trackable(t):
                info = PackInfo("untracked", NO_OWNER, reader, None, None, seg_pack)
                if seg is not None:
                    seg.packs.append((False, None))
                return _kept(self.on_pack(t, info), t)
            if self.is_param(t):
                info = PackInfo("param", NO_OWNER, reader, None, None, seg_pack)
                if seg is not None:
                    seg.packs.append((False, None))
                return _kept(self.on_pack(t, info), t)
            val, _new = self._register(t, self._pack_owner(reader))
            owner = val.owner
            meta = ViewMeta.of(t)
            info = PackInfo(
                "activation", owner, reader, val, meta, seg_pack,
                in_owner_segment=(owner == reader and owner >= 0),
            )
            if seg is not None:
                seg.packs.append((owner == reader and owner >= 0, meta))
            first = not val.saved
            val.saved = True
            val.readers.add(reader)
            self._count_activation(owner, reader, val)
            if first:
                self.on_value_saved(val, t, info)
            out = _kept(self.on_pack(t, info), t)
            if self.watch_packs:
                out = _WatchedPack(out)
                self._watched.append((owner, reader, val, weakref.ref(out)))
            return out
        finally:
            no_modes.__exit__(None, None, None)
            self._busy -= 1

    def _unpack_hook(self, packed: Any) -> torch.Tensor:
        if type(packed) is _WatchedPack:
            packed = packed.packed
        return self.on_unpack(packed)

    def _forget_released_packs(self) -> None:
        """With ``watch_packs``, at the forward's end: the saved tensors whose graph the forward
        already let go of (a branch the model detaches, a value computed only to be compared)
        are no activation of any unit; their values count as saved only through live packs."""
        self._act, self._owned_packs, self._readers = defaultdict(dict), defaultdict(int), defaultdict(set)
        live: Set[int] = set()
        for owner, reader, val, ref in self._watched:
            if ref() is not None:
                live.add(id(val))
                self._count_activation(owner, reader, val)
        for _owner, _reader, val, _ref in self._watched:
            if id(val) not in live:
                val.saved = False
        self._watched.clear()

    def _count_activation(self, owner: int, reader: int, val: ValueRec) -> None:
        """A pack of ``val`` by unit ``reader``'s segment: part of ``owner``'s activations."""
        if owner >= 0:
            self._act[owner][val.storage_id] = val.nbytes
            self._owned_packs[owner] += 1
            self._readers[owner].add(reader)

    # ---------------------------------------------------------------- results

    def _finalize(self) -> None:
        value_id = self.value_ids  # storage id -> value id, numbered as first read
        for rec, seg in zip(self.records, self.segments):
            i = rec.index
            producers: Set[int] = set()
            saved_producers: Set[int] = set()
            positions: Set[int] = set()
            held: Dict[int, int] = {}
            held_owner: Dict[int, int] = {}
            saved_read: Dict[int, Dict[int, int]] = {}
            for ref in seg.inputs:
                owner = ref.value.owner
                pos = model_input_position(owner)
                if pos is not None:
                    positions.add(pos)
                    continue
                if 0 <= owner < i:
                    producers.add(owner)
                    if ref.value.saved:
                        saved_producers.add(owner)
                        saved_read.setdefault(owner, {})[ref.value.storage_id] = ref.value.nbytes
                if not ref.value.saved:
                    held[ref.value.storage_id] = ref.value.nbytes
                    if 0 <= owner < i:
                        held_owner.setdefault(ref.value.storage_id, owner)
            rec.inputs = sorted(producers)
            rec.saved_inputs = sorted(saved_producers)
            rec.model_inputs = sorted(positions)
            outs = self._out_values[i]
            rec.output_bytes = sum({v.storage_id: v.nbytes for v in outs}.values())
            rec.output_saved = any(v.saved for v in outs)
            rec.act_bytes = sum(self._act[i].values())
            rec.act_storages = len(self._act[i])
            rec.packs = len(seg.packs)
            rec.saved_tensors = self._owned_packs[i]
            rec.held_input_bytes = sum(held.values())
            by_owner: Dict[int, int] = {}
            for sid, owner in held_owner.items():
                by_owner[owner] = by_owner.get(owner, 0) + held[sid]
            rec.held_from = sorted(by_owner.items())
            rec.saved_from = sorted((owner, sum(per.values())) for owner, per in saved_read.items())
            rec.held_values = sorted((owner, value_id.setdefault(sid, len(value_id)), held[sid])
                                     for sid, owner in held_owner.items())
            rec.saved_values = sorted((owner, value_id.setdefault(sid, len(value_id)), b)
                                      for owner, per in saved_read.items() for sid, b in per.items())
            rec.inplace = self._inplace[i]
            rec.read_by = sorted(self._readers[i], reverse=True)
