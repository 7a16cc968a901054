"""Published time-model fits, shipped as data (`*.json` in the `strata-timemodel` format) with
their sources in each file's provenance; `derive.py` regenerates them from the published equations.
"""
