from .api import chunk_gated_delta_product, parallel_gated_delta_product, recurrent_gated_delta_product
from .recurrent import gated_delta_product_step

__all__ = ["recurrent_gated_delta_product", "parallel_gated_delta_product", "chunk_gated_delta_product",
           "gated_delta_product_step"]
