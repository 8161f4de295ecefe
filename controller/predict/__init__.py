"""Prediction of round time, traffic and bursts from the run folders the testbed recorded.

A pure function of finished run folders, like the analysis: features come from a run's own
files (``features``), targets from its metrics and analysis (``targets``); three predictors
stand side by side: the protocol's own arithmetic (``analytic``), that skeleton with fitted
coefficients (``greybox``) and black-box regressions (``blackbox``). ``model_file`` fits and
stores them as plain JSON, ``evaluate`` cross-validates by configuration, ``cli`` holds the
``edgetb predict`` commands.
"""
