"""kv_layout — what the bytes are (pure: no I/O, no clock).

Layouts (`LayoutSpec` of `RegionSpec` of `Plane`), presets of known models, page math, the span
builder both sides of a transfer share, the layout hash and diff, and capacity planning.
"""

from kvhandoff.kv_layout.pages import (
    kv_to_page_indices,
    num_pages,
    page_aligned,
    suffix_page_indices,
)
from kvhandoff.kv_layout.planner import GB, GIB, Plan, RegionPlan, handoff_bytes, plan
from kvhandoff.kv_layout.presets import (
    GLM53_INDEXER_LAYER_IDS,
    PRESETS,
    deepseek_v32,
    glm53,
    llama31_8b,
    preset,
)
from kvhandoff.kv_layout.spans import SpanPlan, build_spans
from kvhandoff.kv_layout.spec import (
    LAYOUT_VERSION,
    LayoutSpec,
    Plane,
    RegionSpec,
    SendFrom,
    TPSplit,
    layout_diff,
    layout_hash,
)

__all__ = [
    "GB",
    "GIB",
    "GLM53_INDEXER_LAYER_IDS",
    "LAYOUT_VERSION",
    "PRESETS",
    "LayoutSpec",
    "Plan",
    "Plane",
    "RegionPlan",
    "RegionSpec",
    "SendFrom",
    "SpanPlan",
    "TPSplit",
    "build_spans",
    "deepseek_v32",
    "glm53",
    "handoff_bytes",
    "kv_to_page_indices",
    "layout_diff",
    "layout_hash",
    "llama31_8b",
    "num_pages",
    "page_aligned",
    "plan",
    "preset",
    "suffix_page_indices",
]
