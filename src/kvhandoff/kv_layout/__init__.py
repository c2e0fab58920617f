"""kv_layout — what the bytes are (pure: no I/O, no clock).

Layouts (`LayoutSpec` of `RegionSpec` of `Plane`, packed rows), presets of known models, page
math, the span builder both sides of a transfer share, the layout hash and diff, kernel page
rules, admission and prompt-prefix agreement, and capacity planning.
"""

from kvhandoff.kv_layout.admission import (
    AllocationPolicy,
    DecodeNeed,
    PromptDigest,
    RegionNeed,
    check_capacity,
    check_reservation,
    decode_need,
    first_differing_page,
    policy_mismatch,
    prefix_digest,
    prompt_digest,
    prompt_mismatch,
)
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
from kvhandoff.kv_layout.rules import check_page_rules, peer_page_problems, require_page_rules
from kvhandoff.kv_layout.spans import SpanPlan, build_spans
from kvhandoff.kv_layout.spec import (
    LAYOUT_VERSION,
    LayoutSpec,
    PackedRow,
    PageRule,
    Plane,
    RegionSpec,
    RowPlacement,
    RuleKind,
    SendFrom,
    TPSplit,
    layout_compat_diff,
    layout_diff,
    layout_hash,
)

__all__ = [
    "AllocationPolicy",
    "DecodeNeed",
    "PromptDigest",
    "RegionNeed",
    "check_capacity",
    "check_reservation",
    "decode_need",
    "first_differing_page",
    "policy_mismatch",
    "prefix_digest",
    "prompt_digest",
    "prompt_mismatch",
    "GB",
    "GIB",
    "GLM53_INDEXER_LAYER_IDS",
    "LAYOUT_VERSION",
    "PRESETS",
    "LayoutSpec",
    "PackedRow",
    "PageRule",
    "Plan",
    "Plane",
    "RegionPlan",
    "RegionSpec",
    "RowPlacement",
    "RuleKind",
    "SendFrom",
    "SpanPlan",
    "TPSplit",
    "build_spans",
    "check_page_rules",
    "deepseek_v32",
    "glm53",
    "handoff_bytes",
    "kv_to_page_indices",
    "layout_compat_diff",
    "layout_diff",
    "layout_hash",
    "llama31_8b",
    "num_pages",
    "page_aligned",
    "peer_page_problems",
    "plan",
    "preset",
    "require_page_rules",
    "suffix_page_indices",
]
