"""The pooler: a pooling request's final-norm hidden states, gathered chunk by chunk as its
prompt is prefilled, become one vector when the prompt is done (vLLM's pooler).

Rows are kept by prompt position, so the vector does not depend on how the prompt was chunked,
what ran beside it or whether it was recomputed: LAST keeps the last prompt row, CLS the first,
MEAN every row (in fp32), averaged once at the end. Then the vector is cut to `dimensions`
(Matryoshka) and L2-normalized, as vLLM does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from common.pooling_params import PoolingParams
from engine.model.pooling_config import PoolerConfig


class Pooler:
    """Pooled rows of the requests in flight, by request id."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._rows: dict[str, Tensor] = {}  # LAST / CLS: the row [H]; MEAN: every prompt row [L, H]

    def gather(self, request_id: str, pooling_type: str, start: int, num_prompt: int, rows: Tensor) -> None:
        """Keep what `pooling_type` needs of a chunk's hidden `rows` (prompt positions `start` on)."""
        count = rows.shape[0]
        if pooling_type == "MEAN":
            buffer = self._rows.get(request_id)
            if buffer is None:
                buffer = self._rows[request_id] = torch.zeros((num_prompt, rows.shape[1]), dtype=torch.float32)
            keep = max(0, min(count, num_prompt - start))
            buffer[start : start + keep] = rows[:keep].float().cpu()
        elif pooling_type == "CLS":
            if start == 0:
                self._rows[request_id] = rows[0].float().cpu()
        elif start <= num_prompt - 1 < start + count:  # LAST: the chunk holding the prompt's last row
            self._rows[request_id] = rows[num_prompt - 1 - start].float().cpu()

    def finish(self, request_id: str, params: PoolingParams) -> bytes | None:
        """The request's vector as little-endian float32 bytes (None if nothing was gathered);
        forgets the request."""
        rows = self._rows.pop(request_id, None)
        if rows is None:
            return None
        vector = rows.mean(dim=0) if rows.dim() == 2 else rows
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.config.normalize if params.normalize is None else params.normalize:
            vector = F.normalize(vector, p=2, dim=0)
        return vector.contiguous().numpy().astype("<f4").tobytes()

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted, refused)."""
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)
