from .chunk import chunk_gated_delta_product
from .parallel import parallel_gated_delta_product
from .recurrent import gated_delta_product_step, recurrent_gated_delta_product

__all__ = ["recurrent_gated_delta_product", "parallel_gated_delta_product", "chunk_gated_delta_product",
           "gated_delta_product_step"]
