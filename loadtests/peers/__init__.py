"""Other stores that `strata bench store --against NAME` runs side by side with Strata.

Each peer is an optional extra (`stratakv[peers]`); its driver module imports the peer only
when asked, and says exactly how to get it when it is missing.
"""
