"""The router's pure core (DESIGN §9): placement, admission and time models as plain objects.

No torch, grpc, HTTP framework or pydantic; nothing of `engine` outside this package; no clock
(time comes in as `now`); randomness only from an `rng` passed in. The HTTP shell and the
simulator both drive `RouterCore.decide` with snapshots of the workers.

Modules: `types` (the values), `errors` (the neutral error enum), `timemodel` + `fit` + `lstsq`
(profiled time models and their least-squares fit), `estimate` (TTFT/TPOT of one request on one
worker), `policies` (one module per placement policy), `slo` (SLO classes, admission config),
`admission`, `ledger` (the router's own dispatches), `prediction` (prediction error, drift),
`router` (RouterCore, explain).
"""

from __future__ import annotations

from engine.router.core.admission import Admission
from engine.router.core.errors import ErrorKind, RouterError, UnknownSloClass, error_kind_of
from engine.router.core.ledger import DispatchLedger, Reservation
from engine.router.core.policies import DEFAULT_POLICY, POLICY_NAMES, Policy, build_policy
from engine.router.core.prediction import PredictionTracker
from engine.router.core.router import RouterCore, explain, headers
from engine.router.core.slo import AdmissionConfig, SloClass
from engine.router.core.timemodel import (
    DecodeCoeffs,
    DecodeSample,
    Machine,
    PrefillCoeffs,
    PrefillSample,
    Provenance,
    PullCoeffs,
    PullSample,
    Samples,
    TimeModel,
)
from engine.router.core.types import (
    TIERS,
    Candidate,
    Decision,
    PendingJoin,
    Placement,
    PrefixHit,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    WorkerView,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "TIERS",
    "Admission",
    "AdmissionConfig",
    "Candidate",
    "Decision",
    "DecodeCoeffs",
    "DecodeSample",
    "DispatchLedger",
    "ErrorKind",
    "Machine",
    "PendingJoin",
    "Placement",
    "Policy",
    "PredictionTracker",
    "PrefillCoeffs",
    "PrefillSample",
    "PrefixHit",
    "Provenance",
    "PullCoeffs",
    "PullSample",
    "Refusal",
    "RefusalReason",
    "RequestView",
    "Reservation",
    "Role",
    "RouterCore",
    "RouterError",
    "Samples",
    "SloClass",
    "TimeModel",
    "UnknownSloClass",
    "WorkerView",
    "build_policy",
    "error_kind_of",
    "explain",
    "headers",
]
