"""The attention and the Vision Transformer, as plain ``nn.Module`` s."""

from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import EncoderBlock, PatchEmbedding, VisionTransformer

__all__ = ["EncoderBlock", "MultiHeadSelfAttention", "PatchEmbedding", "VisionTransformer"]
