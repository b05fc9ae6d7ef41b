"""The engine's image path: prefill with pictures, one vision-tower pass per prompt, M-RoPE positions.

A vision-language policy (Qwen2-VL, ``models/vlm.py``) reads a prompt's image as the run of ``<|image_pad|>``
tokens its rendering holds (``rollout/requests.prompt_ids``), whose embeddings are replaced by the vision tower's
merged features, at M-RoPE positions (three ids a token) that grow more slowly than token indices. The local
engine's prefill asks ``EngineImages.inputs`` for the decoder's ``inputs_embeds`` and positions of its
left-padded rows; everything after the prefill is the text path's:

- **Positions, as the trainer computes them.** A row's prompt gets ``vlm.mrope_positions`` (its image tokens
  against its images' grids), and every token after the prompt index + delta in all three components, which is
  what the trainer lays out (``train/vision.py``) and what transformers' cached decode computes. The slot cache
  only ever needs a row's last position: a decode step's position is the last one + 1, passed as one id that the
  model expands to three, so decoding, CUDA graphs, late reads and speculative decoding run unchanged.
- **Only the prompt's image tokens are images.** A re-prefill after a weight update runs prompt + tokens so far;
  an ``<|image_pad|>`` id the policy sampled is a text token there, as it was when it was fed back, and as the
  trainer embeds it.
- **One vision pass per prompt.** A group's G samples share their prompt: the engine's prefill already runs each
  distinct sequence once, and the features of a context's pictures are kept (``feature_cache`` contexts, keyed
  by prompt uid and pictures) so the group's samples admitted in later prefills, and re-prefills of the same
  weights, take them without another pass. A weight update clears them: the vision tower changed (``clear``).
  All images a prefill needs that are not cached go through the tower in one call.
- **Agent turns over kept keys and values.** An episode's next turn extends the turn before token for token, so
  the local engine runs only its last columns over the kept prefix (``reuse_turn_kv``); ``window_inputs`` gives
  those columns' embeddings (the j-th ``<|image_pad|>`` of a continuing context is its pictures' j-th merged
  feature: a turn that samples one ends its episode) and their columns of the whole context's M-RoPE positions,
  at which the kept prefix was computed (a prefix's positions depend only on the prefix).
- **Images across interruption.** They ride on the request (``GenRequest.context_images``: its own, for an agent
  turn whose observations added pictures, else its prompt's), never in engine state that a weight update drops,
  so a re-prefill places the same pictures.

Two prompts with the same tokens and different pictures (every ``count_squares`` prompt is "how many squares?"
over its own picture) are different contexts: ``context_key`` adds the prompt's uid and pictures to the tokens
wherever the engine shares work between identical rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from tidal.api import GenRequest
from tidal.models import vlm
from tidal.utils.images import load_image


def context_key(request: GenRequest, tokens: tuple[int, ...]) -> tuple:
    """What makes two rows' contexts identical: their tokens, and their pictures when they show any."""
    return (_cache_key(request), tokens) if request.context_images else tokens


class EngineImages:
    """Image features and M-RoPE inputs for one engine's prefills (module docstring)."""

    def __init__(self, model: torch.nn.Module, processor, feature_cache: int = 64):
        self.model = model
        self.processor = processor
        config = vlm.hf_model(model).config
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        self.feature_cache = feature_cache
        self._features: OrderedDict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = OrderedDict()
        self.num_vision_passes = 0  # vision-tower calls
        self.num_images_embedded = 0  # images those calls embedded
        self.num_images_reused = 0  # images a prefill took from the cache instead

    def clear(self) -> None:
        """Forget every kept feature (after a weight update)."""
        self._features.clear()

    def stats(self) -> dict[str, float]:
        return {"rollout/vision_passes": float(self.num_vision_passes),
                "rollout/vision_images": float(self.num_images_embedded),
                "rollout/vision_images_reused": float(self.num_images_reused)}

    def inputs(self, ids_bt: torch.Tensor, mask_bt: torch.Tensor,
               requests: Sequence[GenRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder's ``inputs_embeds`` [B, T, hidden] and M-RoPE ``position_ids`` [3, B, T] (on the model's
        device) of left-padded rows ``ids_bt`` (on the host; row b: ``requests[b]``'s prompt ids, then any tokens
        sampled for it), or None when no row shows a picture (the text path then runs as it always did). The layout
        is read on the host, so a prefill with pictures waits on the device no more than a text one."""
        if not any(r.context_images for r in requests):
            return None
        positions_3bt, image_bt, row_features = self._layout(ids_bt, mask_bt, requests)
        placed = [f for f in row_features if f is not None]
        return self._embeds(ids_bt, image_bt, placed), positions_3bt.to(self._device())

    def window_inputs(self, ids_bw: torch.Tensor, mask_bt: torch.Tensor,
                      requests: Sequence[GenRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``inputs`` for the last W columns of left-padded rows whose earlier columns are kept keys and values (the
        local engine's turn reuse, ``_prefill_after``): ``ids_bw`` [B, W] the window's ids and ``mask_bt`` [B, T]
        the whole rows' mask (on the host; row b: ``requests[b]``'s prompt ids, its whole context). The window's
        ``inputs_embeds`` [B, W, hidden] carry the context's image features over its image tokens (every
        ``<|image_pad|>`` of a continuing episode's context is a picture: the j-th takes the j-th merged feature of
        the context's pictures in order, so a window that starts inside or after a picture takes the rest of its
        features), its ``position_ids`` [3, B, W] are the columns of ``vlm.mrope_positions`` of each whole context
        (the kept prefix's keys were computed at exactly those). None when no row shows a picture."""
        if not any(r.context_images for r in requests):
            return None
        b, t = mask_bt.shape
        w = ids_bw.shape[1]
        past = t - w
        ids_bt = torch.zeros(b, t, dtype=torch.long)
        for row, request in enumerate(requests):
            context = torch.as_tensor(request.prompt_ids, dtype=torch.long)
            ids_bt[row, t - len(context):] = context
        assert torch.equal(ids_bt[:, past:][mask_bt[:, past:].bool()], ids_bw[mask_bt[:, past:].bool()]), \
            "the window's ids are not the contexts' last columns"
        positions_3bt, image_bt, row_features = self._layout(ids_bt, mask_bt, requests)
        placed = []
        for row, features in enumerate(row_features):
            if features is not None:  # the features of the row's image tokens before the window are kept keys
                placed.append(features[int(image_bt[row, :past].sum()):])
        return self._embeds(ids_bw, image_bt[:, past:], placed), positions_3bt[:, :, past:].to(self._device())

    def _device(self) -> torch.device:
        return vlm.hf_model(self.model).get_input_embeddings().weight.device

    def _layout(self, ids_bt: torch.Tensor, mask_bt: torch.Tensor, requests: Sequence[GenRequest]
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """On the host: M-RoPE positions [3, B, T] of left-padded rows (0 at padding), where their pictures' tokens
        are [B, T], and each row's merged features of those tokens in order (None: a row without pictures)."""
        features = self._features_of(requests)
        ids_host, mask_host = ids_bt, mask_bt.bool()
        b, t = ids_host.shape
        positions_3bt = torch.zeros(3, b, t, dtype=torch.long)
        image_bt = torch.zeros(b, t, dtype=torch.bool)
        row_features: list[torch.Tensor | None] = []
        for row, request in enumerate(requests):
            p = len(request.prompt_ids)
            real = mask_host[row].nonzero().squeeze(1)  # the row's columns, left-padded
            ids = ids_host[row, real]
            grids, feats = features.get(_cache_key(request), (None, []))
            try:
                pos_3p, delta = vlm.mrope_positions(ids[:p], grids, self.image_token_id, self.merge)
            except ValueError as e:  # the rendering and the pictures disagree: never a silently shifted position
                raise ValueError(f"prompt {request.prompt.uid}: {e}") from None
            columns = real[:p]
            positions_3bt[:, row, columns] = pos_3p
            positions_3bt[:, row, real[p:]] = torch.arange(p + delta, len(real) + delta)  # generated: index + delta
            image_bt[row, columns[ids[:p] == self.image_token_id]] = True
            row_features.append(torch.cat(feats) if feats else None)
        return positions_3bt, image_bt, row_features

    def _embeds(self, ids_bt: torch.Tensor, image_bt: torch.Tensor, placed: list[torch.Tensor]) -> torch.Tensor:
        """The text embeddings of ``ids_bt`` with ``placed`` (in row-major order) over the ``image_bt`` tokens."""
        embed = vlm.hf_model(self.model).get_input_embeddings()
        device = embed.weight.device
        embeds_bth = embed(ids_bt.to(device))
        if placed:
            values = torch.cat(placed).to(device, embeds_bth.dtype)
            embeds_bth = embeds_bth.masked_scatter(image_bt.to(device)[..., None], values)
        return embeds_bth

    def _features_of(self, requests: Sequence[GenRequest]) -> dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]]:
        """Each context's image grids and merged features (per image), from the cache or from one vision pass over
        every picture not cached."""
        out: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        missing: dict[tuple, GenRequest] = {}
        for request in requests:
            key = _cache_key(request)
            if not request.context_images or key in out or key in missing:
                continue
            kept = self._features.get(key)
            if kept is not None:
                self._features.move_to_end(key)
                out[key] = kept
                self.num_images_reused += len(request.context_images)
            else:
                missing[key] = request
        if missing:
            pictures = [load_image(image, f"prompt {r.prompt.uid}, image {k}") for r in missing.values()
                        for k, image in enumerate(r.context_images)]
            pixel_values, grids = vlm.image_batch(self.processor, pictures)
            computed = list(vlm.image_features(self.model, pixel_values, grids))
            self.num_vision_passes += 1
            self.num_images_embedded += len(pictures)
            first = 0
            for key, r in missing.items():
                n = len(r.context_images)
                out[key] = self._features[key] = (grids[first:first + n], computed[first:first + n])
                first += n
            while len(self._features) > self.feature_cache:
                self._features.popitem(last=False)
        return out


def _cache_key(request: GenRequest) -> tuple:
    """A context's kept features are its own: its prompt's uid and its pictures (a data URL, path or bytes as they
    are, cheap to hash at these sizes; anything else by identity), so a uid reused for other pictures, or an
    episode turn that added one, is embedded again."""
    return (request.prompt.uid, *(v if isinstance(v, (str, bytes)) else id(v) for v in request.context_images))
