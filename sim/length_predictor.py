"""An output-length predictor, as a system consults it.

A weather forecast for each request: before a request is seated, the engine guesses how
many tokens it will generate (S3, Jin et al. 2023, trains a small model on the prompt for
this), to reserve that much contiguous memory, or to seat the shortest jobs first (Fu et
al. 2024 rank requests by a learned predictor). The forecast is either a real predictor's,
read from the trace (``source: trace``), or the truth blurred by a log-normal error of
spread ``sigma`` (``source: model``) — median-unbiased, as often twice too long as half too
short at ``sigma`` 0.69. Either way an optional ``headroom`` share is reserved on top to
make shortfalls rarer. Each request's error draw is fixed by the scenario seed alone, so
every system of a run, and every ``sigma`` of a sweep, blurs the same requests the same
way: raising ``sigma`` only scales the errors.
"""

from __future__ import annotations

import numpy as np

from sim.scenario import PredictorConfig
from workloads import Trace

PREDICTION_STREAM = 0x50524544  # a random stream of its own: the trace's draws stay as they were


def predicted_output_lengths(trace: Trace, predictor: PredictorConfig,
                             seed: int) -> list[int]:
    """Per request of ``trace``: the output tokens the predictor expects, at least one and
    at most the request's ``max_tokens`` (a client's limit is known before it runs)."""
    if predictor.source == "trace":
        if (trace.predicted_output < 1).any():  # scenario_trace said which, in a line
            raise ValueError("predictor.source trace: some request has no predicted_output")
        guess = trace.predicted_output.astype(np.float64)
    else:
        z = np.random.default_rng([seed, PREDICTION_STREAM]).standard_normal(len(trace))
        guess = trace.output_len * np.exp(predictor.sigma * z)
    guess = guess * (1.0 + predictor.headroom)
    return np.clip(np.ceil(guess), 1, trace.max_tokens).astype(np.int64).tolist()
