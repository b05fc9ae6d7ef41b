"""The trainer's image path: a batch of vision-language samples laid out once, scored in any layout.

A vision-language policy (Qwen2-VL, ``models/vlm.py``) reads a prompt's image as a run of image-pad tokens
whose embeddings are replaced by the vision tower's merged features, at M-RoPE positions (three ids per
token) that grow more slowly than token indices. Everything the trainer's layouts need for that is computed
once per batch, on the host, by ``batch_images`` (called from ``build_train_batch``):

- each distinct image once: a group's G samples share their prompt's images (``Prompt.images``), and two
  prompts with the same picture (same pixels) share it too; the image processor runs once per distinct image;
- per token, which merged feature it takes (``feature_index_bt``, -1 for text) and its M-RoPE position
  (``position_ids_3bt``: ``vlm.mrope_positions`` over the prompt, then index + delta over the response, as the
  engine decodes it). Only the prompt's image-pad tokens are images: one a policy samples in its response is
  a text token, embedded from the table, as the engine embedded it when it fed it back. A prompt whose image
  tokens do not add up to its images' grids is one error naming the prompt, never a shifted position;
- a trajectory with its own pictures (``Trajectory.images``: an agent episode whose observations showed pictures,
  an endpoint segment) is laid out whole: its pictures behind the image tokens of prompt + response that the
  policy did not sample (the prompt's and the observations'), ``vlm.mrope_positions`` over the whole sequence
  (which equals the engine's prefill of each turn's context, then index + delta), each distinct picture still
  once per batch.

``with_images`` is what the trainer's ``_layout_forward`` hands to ``token_logprobs`` instead of the policy
when the batch has images: the same model (same head, same head kernels and score masks, same autocast),
whose decoder takes ``inputs_embeds`` with the image features placed and the M-RoPE positions of the layout:

- padded: the batch's own positions and feature indices, cut to the micro-batch's rows and columns;
- packed (``trainer.packing``): each sequence's positions and features moved to its slots in the packed row,
  and the position ids passed as transformers' packed M-RoPE expects them, four rows: the per-sequence text
  positions first (which packed-sequence masks and varlen attention read), then the three M-RoPE rows;
- prefix tries (``trainer.share_prefixes``): a node takes the position and feature of every sequence through
  it; the layout checks they agree (a prefix shared token for token is the same prompt with the same images,
  and M-RoPE positions depend only on the prefix), so an image is never shared by two rows that show
  different pictures behind the same tokens.

The vision tower runs once per forward over the distinct images the micro-batch's rows show; each image
token gathers its feature by index, so the gradient of an image used by G rows (or by one trie node) adds
up in that one computation, as in ``vlm.vlm_token_logprobs``.

An FSDP-sharded policy (``parallel/fsdp.py``) runs the same view inside its root's forward: the embeddings, the
vision tower, the final norm and the head are the root unit's parameters, unsharded only there. ``with_images``
then returns a view that ``data_parallel.root_of`` resolves to the root bound to the pass's ``ImageInputs``, and
the root builds the view over its model in its forward (``LogprobModule.forward(..., images=)``). Every rank's pass
over a batch with images gives the vision tower a gradient, zero where its rows show no picture, so the ranks'
reduce-scatters of the root unit carry the same parameters.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from tidal.models import vlm
from tidal.train.data_parallel import SHARDED_ROOT, root_of
from tidal.types import BatchImages, Prompt, Trajectory
from tidal.utils.images import load_image


def batch_images(rows: list[tuple[Prompt, Trajectory]], width: int, processor: Any) -> BatchImages | None:
    """The images of a batch whose row b is ``rows[b]``'s trajectory (prompt + response, right-padded to
    ``width``), or None when no row shows any (the text path then runs unchanged). ``processor``: the policy's
    (``vlm.ImageTextProcessor``: its image processor, ``image_token_id`` and merge size).

    A row's pictures are its prompt's (``Prompt.images``, behind ``prompt_ids``' image tokens), or, for a
    trajectory that carries its own (``Trajectory.images``: an agent episode whose observations showed pictures,
    an endpoint segment), those, behind the image tokens of the whole sequence that the policy did not sample."""
    distinct: dict[tuple, int] = {}
    pictures: list = []

    def index_of(value: Any, where: str) -> int:
        image = load_image(value, where)
        key = (image.size, hashlib.sha256(image.tobytes()).digest())  # the same pixels: one image
        at = distinct.setdefault(key, len(pictures))
        if at == len(pictures):
            pictures.append(image)
        return at

    shown: dict[int, list[int]] = {}  # id(prompt) -> its images' distinct indices: decoded once per group
    own: dict[int, list[int]] = {}  # row -> its trajectory's own pictures' distinct indices
    decoded: dict[Any, int] = {}  # a trajectory's picture given as a string: decoded once per batch
    for b, (prompt, traj) in enumerate(rows):
        if traj.images is not None:
            which = []
            for k, value in enumerate(traj.images):
                key = value if isinstance(value, (str, bytes)) else id(value)
                if key not in decoded:
                    decoded[key] = index_of(value, f"prompt {prompt.uid}, sample {traj.sample_index}, image {k}")
                which.append(decoded[key])
            own[b] = which
        elif id(prompt) not in shown:
            shown[id(prompt)] = [index_of(value, f"prompt {prompt.uid}, image {k}")
                                 for k, value in enumerate(prompt.images)]
    if not pictures:
        return None
    pixel_values, grids = vlm.image_batch(processor, pictures)
    image_token_id, merge = processor.image_token_id, processor.image_processor.merge_size
    sizes = vlm.image_tokens(grids, merge)
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    feature_bt = torch.full((len(rows), width), -1, dtype=torch.long)
    position_3bt = torch.zeros((3, len(rows), width), dtype=torch.long)
    row_images: list[list[int]] = []
    laid: dict[tuple, tuple] = {}  # a group's samples share their prompt: its positions are computed once
    for b, (prompt, traj) in enumerate(rows):
        p, n = len(traj.prompt_ids), len(traj.token_ids)
        if b in own:  # the whole sequence, laid out at once: its pictures may follow sampled tokens
            which = own[b]
            pos_3s, at, features = _sequence_layout(prompt, traj, which, grids, starts, image_token_id, merge)
            position_3bt[:, b, :p + n] = pos_3s
            feature_bt[b, at] = features
            row_images.append(which)
            continue
        which = shown[id(prompt)]
        key = (tuple(traj.prompt_ids), tuple(which))
        if key not in laid:
            laid[key] = _prompt_layout(prompt, traj, which, grids, starts, image_token_id, merge)
        pos_3p, delta, at, features = laid[key]
        position_3bt[:, b, :p] = pos_3p
        position_3bt[:, b, p:p + n] = torch.arange(p + delta, p + n + delta)  # generated: index + delta
        feature_bt[b, at] = features
        row_images.append(which)
    return BatchImages(pixel_values, grids, row_images, feature_bt, position_3bt)


def _sequence_layout(prompt: Prompt, traj: Trajectory, which: list[int], grids: torch.Tensor, starts: list[int],
                     image_token_id: int, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trajectory with its own pictures: M-RoPE positions [3, P + N] of prompt + response, its image tokens'
    indices and their feature indices. The image tokens are the prompt's and the observations' (``loss_mask`` 0);
    one the policy sampled is text, as the engine fed it back. ``mrope_positions`` over the whole sequence equals
    the engine's rule turn by turn (each turn's prefill over its context, index + delta after it): M-RoPE
    positions of a prefix depend on the prefix only."""
    ids_s = torch.tensor([*traj.prompt_ids, *traj.token_ids], dtype=torch.long)
    sampled = torch.zeros(len(ids_s), dtype=torch.bool)
    sampled[len(traj.prompt_ids):] = True if traj.loss_mask is None else torch.tensor(traj.loss_mask, dtype=torch.bool)
    ids_s = ids_s.masked_fill(sampled & (ids_s == image_token_id), -1)  # sampled: not an image to place
    pos_3s, _, at, features = _place(prompt, traj, ids_s, which, grids, starts, image_token_id, merge)
    return pos_3s, at, features


def _prompt_layout(prompt: Prompt, traj: Trajectory, which: list[int], grids: torch.Tensor, starts: list[int],
                   image_token_id: int, merge: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """One prompt's M-RoPE positions [3, P] and rope delta, its image tokens' indices and their feature indices."""
    ids_p = torch.tensor(traj.prompt_ids, dtype=torch.long)
    return _place(prompt, traj, ids_p, which, grids, starts, image_token_id, merge)


def _place(prompt: Prompt, traj: Trajectory, ids: torch.Tensor, which: list[int], grids: torch.Tensor,
           starts: list[int], image_token_id: int, merge: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """M-RoPE positions [3, len(ids)] and rope delta of ``ids`` showing pictures ``which`` behind its image tokens,
    those tokens' indices and their merged features' indices (into the batch's distinct pictures' features)."""
    where = f"prompt {prompt.uid}, sample {traj.sample_index}"
    try:
        pos_3t, delta = vlm.mrope_positions(ids, grids[which] if which else None, image_token_id, merge)
    except ValueError as e:  # tokens and pictures disagree: the engine rendered other pictures than these
        raise ValueError(f"{where}: {e}") from None
    at = (ids == image_token_id).nonzero().squeeze(1)
    if len(at) and int(at[0]) == 0:  # every layout leaves position 0 of a sequence unmapped (nothing predicts it)
        raise ValueError(f"{where}: the sequence starts with an image token; render it after a text token (the "
                         "chat template's role marker)")
    features = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in which]) if which else at[:0]
    return pos_3t, delta, at, features


def with_images(model: Any, batch, rows: torch.Tensor, layout: Any) -> Any:
    """``model`` as ``token_logprobs`` should see it for rows ``rows`` of ``batch`` in ``layout`` (the columns
    used, an int, for the padded layout; a ``PackedRows`` or ``PackedTrees``): ``model`` itself when the batch
    has no images, else a view whose decoder takes the image features and M-RoPE positions (module docstring)."""
    images: BatchImages | None = batch.images
    if images is None:
        return model
    rows = rows.cpu()
    feature_bt, position_3bt = images.feature_index_bt[rows], images.position_ids_3bt[:, rows]
    if isinstance(layout, int):
        feature_rl, position_3rl, ids_rl = feature_bt[:, :layout], position_3bt[:, :, :layout], None
    else:
        feature_rl, position_3rl = _to_layout(layout, feature_bt, position_3bt)
        ids_rl = layout.input_ids_rl
    hf = vlm.hf_model(model)
    if ids_rl is not None:  # the padded rows are the batch's own, whose image tokens ``batch_images`` found
        assert bool((ids_rl[feature_rl >= 0] == hf.config.image_token_id).all()), "an image feature off its token"
    used = sorted({i for r in rows.tolist() for i in images.row_images[r]})
    pixels = grids = None
    if used:  # global feature indices -> indices into the features of the images this pass embeds
        pixels, grids = vlm.image_subset(images.pixel_values, images.image_grid_thw_n3, used)
        sizes = vlm.image_tokens(images.image_grid_thw_n3, hf.config.vision_config.spatial_merge_size)
        starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        local = torch.full((starts[-1],), -1, dtype=torch.long)
        first = 0
        for i in used:
            local[starts[i]:starts[i + 1]] = torch.arange(first, first + sizes[i])
            first += sizes[i]
        feature_rl = torch.where(feature_rl >= 0, local[feature_rl.clamp(min=0)], -1)
    root = root_of(model)
    inputs = ImageInputs(pixels, grids, feature_rl, position_3rl, all_grads=root is not None)
    view = _WithImages(model, inputs)
    if root is not None:  # sharded: the view runs inside the root's forward, which unshards the root unit
        view.__dict__[SHARDED_ROOT] = functools.partial(root, images=inputs)
    return view


def _to_layout(layout, feature_bt: torch.Tensor, position_3bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature indices [R, L] and M-RoPE positions [3, R, L] of a packed or trie layout, from the rows' [B, T]
    ones through the layout's (sequence, position) -> (row, column) map (positions >= 1; position 0 is never an
    image token and always at M-RoPE position 0). A trie node gets the value of every sequence through it: they
    must agree, or the trie would share an image that differs behind the same tokens."""
    src, dest = (layout.source_rows, layout.source_cols), (layout.dest_b, layout.dest_t)
    feature_rl = torch.full(layout.input_ids_rl.shape, -1, dtype=torch.long)
    position_3rl = torch.zeros((3, *layout.input_ids_rl.shape), dtype=torch.long)
    want_feature, want_position = feature_bt[dest], position_3bt[:, dest[0], dest[1]]
    feature_rl[src] = want_feature
    position_3rl[:, src[0], src[1]] = want_position
    if not (bool((feature_rl[src] == want_feature).all()) and bool((position_3rl[:, src[0], src[1]] ==
                                                                     want_position).all())):
        raise ValueError("trainer.share_prefixes: sequences through one trie node show different images or M-RoPE "
                         "positions there (same tokens, other pictures); turn trainer.share_prefixes off")
    return feature_rl, position_3rl


@dataclass(frozen=True)
class ImageInputs:
    """What one forward needs of its rows' images, in its layout: the pixels and grids of the distinct pictures it
    embeds (None when its rows show none), each token's feature index into them (-1: text) and its M-RoPE
    positions. ``all_grads`` (a sharded pass): the vision tower gets a gradient even when the pass embeds no
    picture (zero), as FSDP's reduce-scatter of the root unit must carry the same parameters on every rank."""

    pixel_values: torch.Tensor | None
    image_grid_thw_n3: torch.Tensor | None
    feature_index_rl: torch.Tensor
    position_ids_3rl: torch.Tensor
    all_grads: bool = False

    def over(self, model: Any) -> _WithImages:
        """``model`` as ``token_logprobs`` reads it with these images (what the FSDP root runs in its forward)."""
        return _WithImages(model, self)


class _WithImages:
    """The policy as ``token_logprobs`` reads it (``config``, ``parameters``, ``get_output_embeddings``,
    ``get_decoder``), except that its decoder embeds the tokens itself, places the image features over the image
    tokens and passes M-RoPE positions. The vision tower runs inside that call, so it is under the trainer's
    autocast and counted in its forward phase; once per call, over the distinct images of the call's rows."""

    def __init__(self, model: Any, images: ImageInputs):
        self._model, self.config = model, model.config
        self._pixels, self._grids = images.pixel_values, images.image_grid_thw_n3
        self._image_rl = images.feature_index_rl >= 0
        self._feature_n = images.feature_index_rl[self._image_rl]  # in row-major order, as ``masked_scatter`` fills
        self._position_3rl = images.position_ids_3rl
        self._all_grads = images.all_grads

    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse)

    def get_output_embeddings(self):
        return self._model.get_output_embeddings()

    def get_decoder(self):
        return self._decode

    def _decode(self, input_ids: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None,
                use_cache: bool = False):
        hf = vlm.hf_model(self._model)
        embeds_rlh = hf.get_input_embeddings()(input_ids)
        if self._pixels is not None:
            features = torch.cat(vlm.image_features(hf, self._pixels, self._grids)).to(embeds_rlh.dtype)
            device = embeds_rlh.device
            placed = features[self._feature_n.to(device)]
            embeds_rlh = embeds_rlh.masked_scatter(self._image_rl.to(device)[..., None], placed)
        elif self._all_grads and torch.is_grad_enabled():  # no picture here, maybe on another rank: a zero gradient
            visual = [p for p in hf.model.visual.parameters() if p.requires_grad]
            if visual:
                embeds_rlh = embeds_rlh + 0.0 * sum(p.sum() for p in visual).to(embeds_rlh.dtype)
        positions = self._position_3rl.to(input_ids.device)
        if position_ids is not None:  # a packed layout: its per-sequence text positions lead (transformers' 4 rows)
            positions = torch.cat([position_ids[None], positions])
        return self._model.get_decoder()(inputs_embeds=embeds_rlh, attention_mask=attention_mask,
                                         position_ids=positions, use_cache=use_cache)
