"""One engine step of a served vision-language model: the runner's seam (`VisionStep`).

Positions: 1-D as for text, or for M-RoPE families [3, 1, T], each prompt position taken from
the request's `get_rope_index` rows and every later one (decode, a recompute's generated
tokens) at cache position + the request's own delta (never the model-wide `rope_deltas`).
Features: a step whose prompt chunks cover image placeholders gets them from the encoder
(each image encoded once, cached), and only the rows of the placeholders its chunks cover are
scattered into the token embeddings, in packed token order, at positions known from the
request (not searched for by token id: a generated token that happens to equal the
placeholder id stays text, as in HF's decode). Qwen3-VL's DeepStack rows for those positions
go to the decoder with them. A step without image rows runs the model from its token ids;
decode never touches the vision tower."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.model.inputs import StepBatch
from batchgen.multimodal.encoder import VisionEncoder
from batchgen.multimodal.families import VisionFamily


class VisionStep:
    """Builds a step's model inputs (positions, embeddings with image features) and runs the
    forward; the model and its encoder are the runner's."""

    def __init__(self, model: torch.nn.Module, family: VisionFamily, encoder: VisionEncoder
                 ) -> None:
        self.model = model
        self.family = family
        self.encoder = encoder
        self.embed = model.get_input_embeddings()

    def run(self, rows: StepRows, batch: StepBatch, host_positions: np.ndarray,
            **step: Any) -> torch.Tensor:
        """The step's logits [1, R', vocab] (`step`: logits_to_keep, batchgen_step)."""
        inputs = self.inputs(rows, batch, host_positions)
        if "deepstack_visual_embeds" in inputs:  # the top-level forward takes no DeepStack
            keep = step.pop("logits_to_keep")    # rows from outside: run its decoder, head
            tower = getattr(self.model, "model", self.model)
            hidden = tower.language_model(**inputs, use_cache=False, **step)[0]
            return self.model.lm_head(hidden[:, keep])
        return self.model(**inputs, use_cache=False, **step).logits

    def inputs(self, rows: StepRows, batch: StepBatch, host_positions: np.ndarray
               ) -> dict[str, Any]:
        """position_ids, and input_ids or inputs_embeds (+ DeepStack) for the step."""
        t = len(batch.input_ids)
        out: dict[str, Any] = {"position_ids": self._positions(rows, batch, host_positions[:t])}
        at, feats = self._features(rows, batch)
        if not at:
            out["input_ids"] = batch.input_ids[None]
            return out
        index = torch.from_numpy(np.concatenate(at)).to(batch.input_ids.device)
        embeds = self.embed(batch.input_ids)
        rows_ = torch.cat([f.embeds for f in feats]).to(embeds.dtype)
        out["inputs_embeds"] = embeds.index_copy(0, index, rows_)[None]
        if self.family.deepstack:
            mask = torch.zeros(1, t, dtype=torch.bool, device=embeds.device)
            mask[0, index] = True
            out["visual_pos_masks"] = mask
            out["deepstack_visual_embeds"] = [
                torch.cat(layer).to(embeds.dtype)
                for layer in zip(*(f.deepstack for f in feats))]
        return out

    def spans(self, rows: StepRows, batch: StepBatch) -> dict[int, list[tuple[int, int]]] | None:
        """Each packed sequence's bidirectional images its chunk overlaps (StepMetadata.spans),
        or None when the family attends causally or no chunk holds one."""
        if not self.family.bidirectional or not rows.images:
            return None
        out = {}
        for j, r in enumerate(batch.order.tolist()):
            mm = rows.images.get(r)
            if mm is not None and rows.num_new[r] > 1:
                start = int(rows.starts[r])
                end = start + int(rows.num_new[r])
                near = [(it.start, it.end) for it in mm.items if it.start < end and it.end > start]
                if near:
                    out[j] = near
        return out or None

    def _features(self, rows: StepRows, batch: StepBatch) -> tuple[list[np.ndarray], list]:
        """The packed token indices of the image placeholders the step computes and their
        feature rows (ascending: packed rows in order, images in prompt order)."""
        images = rows.images or {}
        if not images:
            return [], []
        qo = batch.meta.qo_indptr.numpy()
        spans = []
        for j, r in enumerate(batch.order.tolist()):
            mm = images.get(r)
            if mm is None:
                continue
            start = int(rows.starts[r])
            for item, lo, hi in mm.overlapping(start, start + int(rows.num_new[r])):
                spans.append((item, lo, hi, int(qo[j]) - start))
        if not spans:
            return [], []
        cached = self.encoder.features(item for item, *_ in spans)
        at = [item.positions[lo:hi] + shift for item, lo, hi, shift in spans]
        feats = [_slice(cached[item.key], lo, hi) for item, lo, hi, _ in spans]
        return at, feats

    def _positions(self, rows: StepRows, batch: StepBatch, pos: np.ndarray) -> torch.Tensor:
        """[1, T] positions, or M-RoPE's [3, 1, T]: each row's delta added, prompt positions
        of image requests from their get_rope_index rows."""
        if not self.family.mrope:
            return batch.positions[None]
        qo = batch.meta.qo_indptr.numpy()
        order = batch.order
        lens = np.diff(qo[:len(order) + 1])
        delta = np.zeros(len(pos), np.int64)
        if rows.rope_delta is not None:
            delta[:qo[len(order)]] = np.repeat(rows.rope_delta[order], lens)
        out = np.broadcast_to(pos + delta, (3, len(pos))).copy()
        for j, r in enumerate(order.tolist()):
            mm = (rows.images or {}).get(r)
            if mm is None or mm.mrope is None:
                continue
            start = int(rows.starts[r])
            stop = min(start + int(rows.num_new[r]), mm.mrope.shape[1])
            if stop > start:
                out[:, qo[j]:qo[j] + stop - start] = mm.mrope[:, start:stop]
        return torch.from_numpy(out)[:, None].to(batch.positions.device)


def rope_index_of(model: torch.nn.Module) -> Any:
    """The model's own M-RoPE position function over one processed prompt: (positions
    [3, 1, L], delta [1, 1]) from its input ids and the processor's grids and token types."""
    tower = getattr(model, "model", model)

    def rope_index(input_ids: torch.Tensor, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kw = {k: out[k] for k in ("mm_token_type_ids", "image_grid_thw") if k in out}
        return tower.get_rope_index(input_ids, **kw)

    return rope_index


def _slice(feats: Any, lo: int, hi: int) -> Any:
    """Rows [lo, hi) of one image's features (and its DeepStack rows)."""
    return type(feats)(feats.embeds[lo:hi], tuple(d[lo:hi] for d in feats.deepstack))
