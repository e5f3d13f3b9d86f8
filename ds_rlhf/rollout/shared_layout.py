"""The layout of `rollout.weight_transport shared` (pure: no vLLM import): where each vLLM parameter lies in the one
flat buffer the trainer owns, which Hugging Face tensors fill it, and how large the trainer makes that buffer.

A vLLM parameter is described by a `ParamSpec`: its name, shape and components, the HF tensors stacked along dim 0
from row 0 in order. A packed parameter (`qkv_proj`, `gate_up_proj`, their biases) has one component per entry of
the model class's `packed_modules_mapping` (`packed_spec`, sizes from the layer's `output_sizes`); any other has
one, itself (`plain_spec`), with fewer rows than the parameter where vLLM pads a vocabulary to a multiple of
`VOCAB_PAD_ROWS`. With tensor parallel 1 each component is then one contiguous slice of the buffer: `plan_layout`
places every parameter at an offset aligned to `ALIGN_BYTES` and returns one `Slot` (HF name, element offset,
shape) per component, the places the trainer writes to. `buffer_numel` is what the trainer allocates before any
server starts, from its own parameters' shapes (`model_parameter_shapes`; the memory plan counts it the same way):
their elements, each aligned, vocabularies padded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ds_rlhf.rollout.base import RolloutError

ALIGN_BYTES = 256  # every parameter starts at a multiple of this many bytes of the buffer
VOCAB_PAD_ROWS = 64  # vLLM pads vocabulary embeddings to a multiple of 64 rows (DEFAULT_VOCAB_PADDING_SIZE)


@dataclass(frozen=True)
class ParamSpec:
    """One vLLM parameter: its name, shape and the HF tensors (name, rows along dim 0) stacked in it from row 0."""

    name: str
    shape: tuple[int, ...]
    components: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Slot:
    """Where the HF tensor `name` lives: `shape` elements from element `offset` of the buffer, contiguous."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def aligned(elements: int, element_size: int) -> int:
    """`elements` rounded up to the next multiple of `ALIGN_BYTES` bytes."""
    step = max(1, ALIGN_BYTES // element_size)
    return -(-elements // step) * step


def plain_spec(name: str, shape: Sequence[int], rows: int | None = None) -> ParamSpec:
    """A parameter holding one HF tensor of the same name: all its rows, or the first `rows` (a padded vocabulary)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return ParamSpec(name, shape, ((name, 0),))
    return ParamSpec(name, shape, ((name, shape[0] if rows is None else int(rows)),))


def packed_spec(name: str, shape: Sequence[int], mapping: Mapping[str, Sequence[str]],
                output_sizes: Sequence[int]) -> ParamSpec:
    """A packed parameter (`...qkv_proj.weight`): the HF tensors its `mapping` entry names (`q_proj`, `k_proj`,
    `v_proj`), `output_sizes` rows each, stacked along dim 0. RolloutError where the sizes do not fill dim 0."""
    shape = tuple(int(s) for s in shape)
    parts = name.split(".")
    packed = [i for i, p in enumerate(parts) if p in mapping]
    if not packed:
        raise RolloutError(f"shared weights: {name} is not a packed module of {sorted(mapping)}")
    i = packed[-1]
    names = [".".join([*parts[:i], c, *parts[i + 1:]]) for c in mapping[parts[i]]]
    sizes = [int(s) for s in output_sizes]
    if not shape or len(sizes) != len(names) or sum(sizes) != shape[0]:
        raise RolloutError(f"shared weights: {name} {list(shape)} packs {names} with output sizes {sizes}, which "
                           "do not stack to its first dimension (tensor parallel > 1 or an unknown packing)")
    return ParamSpec(name, shape, tuple(zip(names, sizes)))


def plan_layout(specs: Iterable[ParamSpec], element_size: int) -> tuple[list[int], list[Slot], int]:
    """Each parameter's element offset (aligned), every component's `Slot`, and the elements the layout spans.
    RolloutError where components overflow their parameter or an HF name comes twice."""
    offsets, slots, end = [], [], 0
    for spec in specs:
        start = aligned(end, element_size)
        offsets.append(start)
        row = math.prod(spec.shape[1:])
        used = 0
        for hf, rows in spec.components:
            shape = (rows, *spec.shape[1:]) if spec.shape else ()
            slots.append(Slot(hf, start + used * row, shape))
            used += rows
        if spec.shape and used > spec.shape[0]:
            raise RolloutError(f"shared weights: the components of {spec.name} take {used} rows of "
                               f"{spec.shape[0]}")
        end = start + math.prod(spec.shape)
    seen: set[str] = set()
    for slot in slots:
        if slot.name in seen:
            raise RolloutError(f"shared weights: {slot.name} fills two parameters of the vLLM model")
        seen.add(slot.name)
    return offsets, slots, end


def model_parameter_shapes(model) -> tuple[list[tuple[str, tuple[int, ...]]], set[str]]:
    """A Hugging Face model's parameters as the trainer syncs them: (name, shape) each, tied ones once, and the names
    of its vocabulary embeddings (input and output), the `buffer_numel` inputs. Any device, the meta one too."""
    embeddings = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    vocab = {id(m.weight) for m in embeddings}
    named = list(model.named_parameters())
    return [(n, tuple(p.shape)) for n, p in named], {n for n, p in named if id(p) in vocab}


def buffer_numel(named_shapes: Iterable[tuple[str, Sequence[int]]], element_size: int,
                 vocab_names: Iterable[str] = ()) -> int:
    """Elements of the shared buffer for the trainer's parameters (tied ones once): each parameter's elements
    rounded up to the alignment, the parameters in `vocab_names` (the embeddings) padded to `VOCAB_PAD_ROWS` rows
    as vLLM pads them."""
    vocab = set(vocab_names)
    total = 0
    for name, shape in named_shapes:
        shape = tuple(int(s) for s in shape)
        if name in vocab and shape:
            shape = (-(-shape[0] // VOCAB_PAD_ROWS) * VOCAB_PAD_ROWS, *shape[1:])
        total = aligned(total, element_size) + math.prod(shape)
    return aligned(total, element_size)


def slots_to_wire(slots: Iterable[Slot]) -> list[tuple[str, int, tuple[int, ...]]]:
    """The layout as plain tuples (what a server's 'start' reply carries)."""
    return [(s.name, s.offset, tuple(s.shape)) for s in slots]


def slots_from_wire(wire: Iterable[Sequence]) -> list[Slot]:
    return [Slot(str(n), int(o), tuple(int(x) for x in s)) for n, o, s in wire]
