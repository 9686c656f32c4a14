"""Scoring a call's rows: InferenceService's logits for them, and the calibrated results per row.

A request's rows go, in this order, through:

1. **cache** (:mod:`.cache`, backends in :mod:`.backends` and :mod:`.redis_backend`, keys in :mod:`.keys`): a fresh entry per row is served
   without calling inference; concurrent misses for one row share one flight (single-flight), and
   a stale entry stands in when inference cannot be used;
2. **coalescer** (:mod:`.coalescer`): the flights of concurrent requests for one
   :class:`~mlpair.contracts.target.ModelTarget` go out together as one Infer call;
3. **resilience** (:mod:`.resilience`): each merged call within the callers' deadline budget,
   with retries of retryable failures and a circuit breaker;
4. **inference client** (:mod:`.client`): the gRPC call to InferenceService, its failures
   turned into this service's typed errors.

:mod:`.factory` builds that chain once (:func:`~.factory.build_scorer`, under the client
:func:`~.factory.build_inference_client` makes), each layer injected into the one before it; a
table's rows (PredictColumns) skip the cache (:meth:`.cache.CachedInference.score_uncached`). :mod:`.scorer` packs a call's groups into such calls per model version and
calibrates the logits ``[rows, n_classes] float32`` row by row (:mod:`.calibration`).
"""
