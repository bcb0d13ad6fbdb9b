"""The engine toolkit (``switchyard-engine``): what hardware engines share.

Model loading and its checks, batched sampling, prompt logprobs, grammar
masks, calibration, liveness and lifecycle. It depends on the plugin contract
(``switchyard_spec``), torch and a few model libraries, never on the gateway,
so a plugin installs without the server. The submodules import torch; this
package itself stays cheap to import.
"""
