"""Calibrations of a deployment from its own starts, and a shape model for before the first.

`shape`: a model's shape from its config.json or the spec. `starts`: a start report
(CAPPLAN_REPORT) read and checked against the plan it ran, several starts merged into one
calibration, and the calibration folder found beside the plans. `price`: capture seconds and
graph memory of a plan, each with an interval and its basis: measured starts of this
deployment when there are any, else the shape model fitted on every calibration the project
holds (`capplan/data/calibrations/`).
"""
