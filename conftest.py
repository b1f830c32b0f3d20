"""Suite-wide settings for tests/ and integration-tests/ (here, at the root, so both folders get them).

int4 layers on CPUs round activations to int8 by default (`serve --cpu-int8-activations auto`,
kernels/cpu_act_int8.py). The suite's exactness tests compare layers and models against exact
references (dequantized weights, transformers), so it runs with exact activations unless the caller
chose (`TGS_CPU_INT8_ACTIVATIONS=auto pytest ...` runs it under the default); tests/test_cpu_act_int8.py
sets the policy per test.
"""

import os

os.environ.setdefault("TGS_CPU_INT8_ACTIVATIONS", "off")
