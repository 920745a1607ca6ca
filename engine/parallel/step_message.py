"""One step's model inputs as one int64 tensor: what rank 0 broadcasts and the other ranks run.

Layout: a fixed header (`Header`), then the payload in this order: input ids, positions, slots
[T each], prefill query starts [P + 1], prefill context lengths [P], prefill rows at prompt
positions [P] (-1 each: all of them), block tables [rows x width]
(prefill rows first), decode context lengths [D], swap-out, swap-in and copy pairs [2 each], and
each row's LoRA adapter slot [T] where the step has adapters (`lora` in the header: T, else 0).
A LORA message carries an adapter placement instead (`engine.model.lora.mirror`).
The message is sent as a fixed-size first part (`FIRST_PART` int64) and, only when it is longer,
the rest in a second broadcast (`engine.parallel.channel`), so a step costs one broadcast unless
its block tables are large.
"""

from __future__ import annotations

from enum import IntEnum

import torch
from torch import Tensor

from engine.model.step_inputs import StepInputs

FIRST_PART = 4096  # int64 values in the first broadcast (32 KiB): decode of 64 sequences x 48 blocks fits


class Command(IntEnum):
    """What a message asks of the ranks."""

    STEP = 1  # move blocks, run the model over the inputs
    SHUTDOWN = 2
    LORA = 3  # put an adapter's weights in a slot, or empty it (payload: `engine.model.lora.mirror`)


HEADER = ("command", "length", "num_tokens", "num_prefills", "num_prefill_tokens", "num_decodes", "width",
          "num_swap_out", "num_swap_in", "num_copy", "lora")


def _pairs(pairs: list[tuple[int, int]]) -> Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1)


def pack(inputs: StepInputs, command: Command = Command.STEP) -> Tensor:
    """The message of `inputs` (int64, CPU)."""
    t, p = int(inputs.input_ids.shape[0]), inputs.num_prefills
    d, width = int(inputs.decode_context_lens.shape[0]), int(inputs.block_tables.shape[1])
    parts = [inputs.input_ids, inputs.positions, inputs.slots,
             torch.tensor(inputs.prefill_query_start + inputs.prefill_context_lens
                          + (inputs.prefill_exact_lens or [-1] * p), dtype=torch.int64),
             inputs.block_tables.reshape(-1).long(), inputs.decode_context_lens.long(),
             _pairs(inputs.swap_out), _pairs(inputs.swap_in), _pairs(inputs.copy)]
    lora = 0
    if inputs.lora_slots is not None:
        parts.append(inputs.lora_slots)
        lora = int(inputs.lora_slots.shape[0])
    payload = torch.cat([x.reshape(-1).to(torch.int64) for x in parts])
    header = [int(command), len(HEADER) + int(payload.shape[0]), t, p, inputs.prefill_query_start[-1], d, width,
              len(inputs.swap_out), len(inputs.swap_in), len(inputs.copy), lora]
    return torch.cat([torch.tensor(header, dtype=torch.int64), payload])


def control(command: Command, payload: Tensor | None = None) -> Tensor:
    """A message without step inputs: SHUTDOWN, or LORA with its `payload` (int64)."""
    size = 0 if payload is None else int(payload.shape[0])
    header = torch.tensor([int(command), len(HEADER) + size] + [0] * (len(HEADER) - 2), dtype=torch.int64)
    return header if payload is None else torch.cat([header, payload])


def control_payload(message: Tensor) -> Tensor:
    """What follows the header of a control message."""
    return message[len(HEADER) : header(message)["length"]]


def header(message: Tensor) -> dict[str, int]:
    """The header fields of a message (or of its first part)."""
    return dict(zip(HEADER, message[: len(HEADER)].tolist(), strict=True))


def unpack(message: Tensor) -> StepInputs:
    """The `StepInputs` of a STEP message (views into `message` where the dtype allows)."""
    h = header(message)
    t, p, d, width = h["num_tokens"], h["num_prefills"], h["num_decodes"], h["width"]
    sizes = [t, t, t, 3 * p + 1, (p + d) * width, d, 2 * h["num_swap_out"], 2 * h["num_swap_in"], 2 * h["num_copy"],
             h["lora"]]
    ids, positions, slots, prefill, tables, ctx, out, into, copy, lora = message[len(HEADER) : h["length"]].split(sizes)
    prefill_values = prefill.tolist()

    def pairs(x: Tensor) -> list[tuple[int, int]]:
        values = x.tolist()
        return list(zip(values[0::2], values[1::2], strict=True))

    exact = prefill_values[2 * p + 1 :]
    return StepInputs(input_ids=ids, positions=positions, slots=slots, prefill_query_start=prefill_values[: p + 1],
                      prefill_context_lens=prefill_values[p + 1 : 2 * p + 1],
                      block_tables=tables.to(torch.int32).reshape(p + d, width),
                      decode_context_lens=ctx.to(torch.int32), swap_out=pairs(out), swap_in=pairs(into),
                      copy=pairs(copy), prefill_exact_lens=None if not exact or -1 in exact else exact,
                      lora_slots=lora if h["lora"] else None)
