"""The Vision Transformer: encoder blocks and classification head over models/stem.py's tokens.

Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", eq. 1-4:

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos                     (eq. 1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                                   (eq. 2)
    z_l = MLP(LN(z'_l)) + z'_l                                          (eq. 3)
    y = LN(z_L^0) -> linear head                                        (eq. 4)

With ``distillation=True``, DeiT's distillation token (Touvron et al. 2021, "Training
data-efficient image transformers & distillation through attention", section 4): a second
learned token beside the CLS token, read by a head of its own, which training matches to a
teacher's hard labels or softened outputs (vit_mnist/training/distillation.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchvision.ops import StochasticDepth

from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.checks import check_vit_args
from vit_mnist.models.stem import ConvStem, PatchEmbedding


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Dropout -> Linear -> Dropout.

    Shapes: (batch, tokens, embed_dim) -> (batch, tokens, embed_dim).
    """

    def __init__(self, *, embed_dim: int, hidden_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, embed_dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: ViT eq. 2 and 3, one residual line each, around
    the given attention ``attn`` and an MLP ``round(embed_dim * mlp_ratio)`` wide.

    Shapes: (batch, tokens, embed_dim) -> (batch, tokens, embed_dim); with
    ``need_weights=True`` also the attention weights (batch, num_heads, tokens, tokens).
    """

    def __init__(
        self, attn: MultiHeadSelfAttention, *, mlp_ratio: float, dropout: float, drop_path: float
    ) -> None:
        super().__init__()
        embed_dim = attn.embed_dim
        # Stochastic depth (Huang et al. 2016): in training, each image skips the residual
        # branch with probability drop_path (the survivors are scaled by 1 / (1 - p)).
        self.drop_path = StochasticDepth(drop_path, mode="row")
        self.norm1 = nn.LayerNorm(embed_dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(embed_dim)
        self.mlp = MLP(
            embed_dim=embed_dim, hidden_dim=round(embed_dim * mlp_ratio), dropout=dropout
        )

    def forward(
        self, x: torch.Tensor, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        attn_out = self.attn(self.norm1(x), need_weights=need_weights)
        attn_out, weights = attn_out if need_weights else (attn_out, None)
        x = x + self.drop_path(attn_out)  # z'_l = MSA(LN(z_{l-1})) + z_{l-1}   (eq. 2)
        x = x + self.drop_path(self.mlp(self.norm2(x)))  # z_l = MLP(LN(z'_l)) + z'_l  (eq. 3)
        return (x, weights) if need_weights else x


def average_heads(cls_logits: torch.Tensor, dist_logits: torch.Tensor) -> torch.Tensor:
    """DeiT's prediction (section 4): the log of the CLS and distillation heads' softmax
    averaged, float32 (B, num_classes), from their logits (B, num_classes) each."""
    return ((cls_logits.float().softmax(-1) + dist_logits.float().softmax(-1)) / 2).log()


class VisionTransformer(nn.Module):
    """ViT classifier for small single-channel images such as MNIST.

    All arguments are keyword-only plain values, so a checkpoint can store them and
    rebuild the model without the training config.

    Args:
        img_size: image height = width, in pixels.
        patch_size: patch side in pixels; must divide ``img_size``.
        in_chans: image channels (1 for MNIST).
        num_classes: number of output logits.
        embed_dim: token width D.
        depth: number of encoder blocks L.
        num_heads: attention heads per block; must divide ``embed_dim`` unless ``head_dim``
            is given. A list gives each block its own count (a pruned model's).
        head_dim: features per head d_k; default ``embed_dim // num_heads``.
        mlp_ratio: MLP hidden width = ``round(embed_dim * mlp_ratio)``.
        dropout: dropout after the embedding, in the MLP and after attention's W^O.
        attn_dropout: dropout on the attention weights.
        attention_impl: ``"explicit"`` or ``"fused"`` (``"auto"``, which older checkpoints
            store, is explicit), see :class:`MultiHeadSelfAttention`.
        causal: causal mask in every block (tokens attend to earlier tokens only; the
            CLS token is token 0, so it then sees only itself).
        qkv_bias: bias on the Q, K, V projections.
        drop_path_rate: stochastic depth of the last block; block ``i`` drops its residual
            branches with probability ``drop_path_rate * i / (depth - 1)`` (the linear rule
            of Huang et al. 2016, as in DeiT and timm). 0 turns it off.
        distillation: add DeiT's distillation token (token 1) and its head ``head_dist``;
            the prediction is then the two heads' softmax averaged (DeiT section 4), see
            :meth:`forward_head`. False builds the textbook model, parameter for parameter.
        stem: ``"patch"``, the textbook patch embedding, or ``"conv"``, the hybrid's
            convolutional stem (:class:`~vit_mnist.models.stem.ConvStem`, ``stem_channels``
            wide with ``stem_strides``, None for their defaults) onto the same token grid.

    Shapes: images (batch, in_chans, img_size, img_size) float -> logits (batch, num_classes).
    Tokens: the CLS token (and with ``distillation`` the distillation token), then
    ``(img_size // patch_size) ** 2`` patch tokens; ``num_prefix_tokens`` counts the first.

    Raises:
        ConfigError (a ValueError): an impossible combination, naming the values.
    """

    def __init__(
        self,
        *,
        img_size: int = 28,
        patch_size: int = 4,
        in_chans: int = 1,
        num_classes: int = 10,
        embed_dim: int = 64,
        depth: int = 6,
        num_heads: int | list[int] = 4,
        head_dim: int | None = None,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        attention_impl: str = "explicit",
        causal: bool = False,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        distillation: bool = False,
        stem: str = "patch",
        stem_channels: Sequence[int] | None = None,
        stem_strides: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        check_vit_args(**{k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self.img_size, self.in_chans, self.num_heads, self.depth = (
            img_size,
            in_chans,
            num_heads,
            depth,
        )
        heads = [num_heads] * depth if isinstance(num_heads, int) else list(num_heads)
        pixels = {"img_size": img_size, "patch_size": patch_size, "in_chans": in_chans}
        self.patch_embed = (
            PatchEmbedding(**pixels, embed_dim=embed_dim)
            if stem == "patch"
            else ConvStem(
                **pixels, embed_dim=embed_dim, channels=stem_channels, strides=stem_strides
            )
        )
        self.num_prefix_tokens = 2 if distillation else 1
        self.num_tokens = self.patch_embed.num_patches + self.num_prefix_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distillation else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            EncoderBlock(
                MultiHeadSelfAttention(
                    embed_dim=embed_dim,
                    num_heads=heads[i],
                    head_dim=head_dim,
                    qkv_bias=qkv_bias,
                    attn_dropout=attn_dropout,
                    proj_dropout=dropout,
                    causal=causal,
                    impl=attention_impl,
                ),
                mlp_ratio=mlp_ratio,
                dropout=dropout,
                drop_path=drop_path_rate * i / max(depth - 1, 1),
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes) if distillation else None
        self.init_weights()

    def init_weights(self) -> None:
        """Truncated-normal(0.02) for weights and embeddings, zeros for biases (as in timm);
        LayerNorms keep their own ones and zeros."""
        for token in (self.pos_embed, self.cls_token, self.dist_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Conv2d):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def prefix_tokens(self, batch: int) -> list[torch.Tensor]:
        """The CLS token (and the distillation token), each (batch, 1, D), as views."""
        # expand, not einops.repeat: einops keys its backends by exact type, so a Parameter
        # argument registered a second backend in the middle of torch.compile's first trace,
        # and every process compiled the model one more time (about 2.4 s each).
        tokens = [self.cls_token] if self.dist_token is None else [self.cls_token, self.dist_token]
        return [t.expand(batch, -1, -1) for t in tokens]

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> tokens (B, num_tokens, embed_dim), the prefix tokens first,
        with the position embedding added (ViT eq. 1)."""
        x = self.patch_embed(x)  # (B, N, D)
        tokens = torch.cat([*self.prefix_tokens(x.shape[0]), x], dim=1)
        return self.pos_drop(tokens + self.pos_embed)  # (B, T, D)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> normalised tokens (B, num_tokens, embed_dim)."""
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (B, T, embed_dim) -> the CLS head's logits (B, num_classes) (eq. 4) and the
        distillation head's from token 1 (B, num_classes), or None without distillation."""
        dist = None if self.head_dist is None else self.head_dist(x[:, 1])
        return self.head(x[:, 0]), dist

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T, embed_dim) -> logits (B, num_classes) from the CLS token (eq. 4).

        With distillation: the log of the two heads' softmax averaged (DeiT section 4), in
        float32. Its softmax is that average, so the cross-entropy, the accuracy and a
        test-time average of softmaxes treat it as any logits."""
        cls, dist = self.forward_heads(x)
        return cls if dist is None else average_heads(cls, dist)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes)."""
        return self.forward_head(self.forward_features(x))

    def forward_with_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Images (B, C, H, W) -> logits (B, num_classes) and every block's attention weights
        (``depth`` tensors (B, block's num_heads, T, T), rows summing to 1), computed by the
        explicit path whatever ``attention_impl`` the model was built with."""
        x = self.embed(x)
        weights = []
        for block in self.blocks:
            x, w = block(x, need_weights=True)
            weights.append(w)
        return self.forward_head(self.norm(x)), weights
