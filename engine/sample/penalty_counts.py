"""Per-sequence token counts for the penalties, kept across steps: each penalized sequence owns
a row of a [slots, vocab] count matrix (its output tokens) and of a [slots, vocab] "seen in the
prompt" mask, filled once when the sequence is first penalized. A step adds only the tokens
sampled since the last one (one scatter for the whole batch) and gathers the rows it needs,
instead of rebuilding both matrices from Python lists, prompt included. A row is freed once its
sequence has finished; a sequence whose output got shorter than what was counted (never in
practice) is recounted from scratch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sched.sequence import Sequence


@dataclass(slots=True, eq=False, kw_only=True)
class _Row:
    seq: Sequence
    slot: int
    counted: int = 0  # output tokens already in the row
    prompt_done: bool = False


class PenaltyCounts:
    """The count rows of the sequences being penalized (one instance per engine)."""

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}  # by seq_id
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # [capacity, vocab] float32
        self._seen: torch.Tensor | None = None  # [capacity, vocab] bool: token in the prompt

    def __len__(self) -> int:
        return len(self._rows)

    def gather(self, seqs: list[Sequence], vocab: int, device: torch.device,
               with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[len(seqs), vocab] output-token counts of `seqs`, and (`with_prompt`) whether each
        token occurs in the sequence's prompt; both up to date with `seq.token_ids`."""
        self._release({seq.seq_id for seq in seqs})
        rows = [self._row(seq) for seq in seqs]
        counts, seen = self._storage(vocab, device)
        add_slots: list[int] = []
        add_tokens: list[int] = []
        for row in rows:
            new = row.seq.token_ids[row.seq.num_prompt_tokens + row.counted:]
            add_slots += [row.slot] * len(new)
            add_tokens += new
            row.counted += len(new)
        if add_tokens:
            index = (torch.tensor(add_slots, dtype=torch.long, device=device),
                     torch.tensor(add_tokens, dtype=torch.long, device=device))
            counts.index_put_(index, torch.ones(len(add_tokens), device=device), accumulate=True)
        slots = torch.tensor([row.slot for row in rows], dtype=torch.long, device=device)
        if not with_prompt:
            return counts.index_select(0, slots), None
        for row in rows:
            if not row.prompt_done:
                prompt = row.seq.token_ids[: row.seq.num_prompt_tokens]
                seen[row.slot].zero_()
                if prompt:
                    seen[row.slot, torch.tensor(prompt, dtype=torch.long, device=device)] = True
                row.prompt_done = True
        return counts.index_select(0, slots), seen.index_select(0, slots)

    def _row(self, seq: Sequence) -> _Row:
        row = self._rows.get(seq.seq_id)
        if row is not None and row.seq is seq and row.counted <= seq.num_output_tokens:
            return row
        slot = row.slot if row is not None else (self._free.pop() if self._free else len(self._rows) + len(self._free))
        if self._counts is not None and slot < self._counts.shape[0]:
            self._counts[slot].zero_()
        row = _Row(seq=seq, slot=slot)
        self._rows[seq.seq_id] = row
        return row

    def _release(self, live: set[int]) -> None:
        """Free the rows of finished sequences that this step does not use."""
        done = [sid for sid, row in self._rows.items() if sid not in live and row.seq.is_finished]
        for sid in done:
            self._free.append(self._rows.pop(sid).slot)

    def _storage(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrices, grown (doubling) to hold every claimed slot; new rows are zero."""
        need = max((row.slot for row in self._rows.values()), default=-1) + 1
        counts, seen = self._counts, self._seen
        if counts is None or seen is None or counts.shape[1] != vocab or counts.device != device:
            counts = torch.zeros((max(need, 8), vocab), dtype=torch.float32, device=device)
            seen = torch.zeros((max(need, 8), vocab), dtype=torch.bool, device=device)
            for row in self._rows.values():  # a fresh matrix: everything is recounted
                row.counted, row.prompt_done = 0, False
        elif need > counts.shape[0]:
            size = max(need, 2 * counts.shape[0])
            counts = torch.cat([counts, counts.new_zeros((size - counts.shape[0], vocab))])
            seen = torch.cat([seen, seen.new_zeros((size - seen.shape[0], vocab))])
        self._counts, self._seen = counts, seen
        return counts, seen
