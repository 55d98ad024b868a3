"""pydantic v2 models: the spec users write and the plan capplan writes."""

from capplan.schemas.plan import Descriptor, DispatchRange, DummyLayout, Plan, PlannedGraph
from capplan.schemas.spec import CudagraphMode, Fix, Spec

__all__ = [
    "CudagraphMode",
    "Descriptor",
    "DispatchRange",
    "DummyLayout",
    "Fix",
    "Plan",
    "PlannedGraph",
    "Spec",
]
