"""Planning layer (pure): descriptor rows, TP plans, layout pairing and request plans.
Values in, values out (NumPy arrays and frozen dataclasses); no I/O."""

from kvxfer.planning.descriptors import dense_rows, layout_rows, reference_rows, row_starts
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.plans import PeerPlan, SourcePlan
from kvxfer.planning.request import RequestIds, RequestPlan, SourceIds, plan_request
from kvxfer.planning.tp import TpPlan, plan_tp

__all__ = [
    "PeerPlan",
    "RequestIds",
    "RequestPlan",
    "SourceIds",
    "SourcePlan",
    "TpPlan",
    "dense_rows",
    "layout_rows",
    "pair_layouts",
    "plan_request",
    "plan_tp",
    "reference_rows",
    "row_starts",
]
