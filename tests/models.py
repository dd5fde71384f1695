"""The test models live in the package (tensorplace.models) so that tensorplace-bench can use them."""

from tensorplace.models import Block, CausalSelfAttention, ConvBN, InceptionBlock, TinyGPT, TinyInception  # noqa: F401
