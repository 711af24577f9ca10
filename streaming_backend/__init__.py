"""The pure core of the streaming token server: loading, sampling, detokenising, the engine.

Nothing here imports Triton, tritonclient or websockets; the Triton model and the bridge are
adapters. Import from the submodules (`streaming_backend.engine`, ...): this file imports nothing
heavy, so that light users such as the launcher do not pay for importing torch.

It sets one thing, before torch can load: OpenMP's threads (torch's CPU operations) wait for
work asleep, not spinning (`OMP_WAIT_POLICY=PASSIVE`, unless the environment says otherwise). A
decode step runs our kernels on a thread team of their own between torch's operations, and
libgomp's workers spinning after each of torch's parallel regions took the second core from
that team (docs/design.md, "The served path on two cores"). The model processes read it on
import, and the launcher's children inherit it from the supervisor, which imports this package.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
