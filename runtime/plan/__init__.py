"""Placement plans (`ft plan`): how one model runs on one machine, made ahead of serving and stored in the FTW.

`build.make_plan` (VRAM split, resident experts, page-locked banks, predicted speed from `speed.py`) over a routing
profile (`routing.py`: a server's routing counts, `calibrate.py`, or the uniform prior), `build.write_plan` into the
FTW; `select.choose_placement` is what an engine starts from; `report.py` prints and draws a plan. The schema and its
validation are the format's (`ft.formats.plan`, specs/plan.md).
"""
