"""``autoglm-trt serve``: an engine as an OpenAI-compatible HTTP service (the ``serve`` extra).

``protocol`` (the wire format), ``serving`` (requests -> engine calls -> responses and SSE),
``metrics`` (Prometheus), ``app`` (routes, auth, errors), ``server`` (uvicorn, SIGTERM drain).
Importing ``autoglm_trt.runtime`` does not import any of this.
"""
