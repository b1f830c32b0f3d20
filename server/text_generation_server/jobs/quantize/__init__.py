"""`text-generation-server quantize`: a dense checkpoint in, a GPTQ checkpoint out.

options.py (what a run is asked), calibration.py (a layer's linears and the calibration
forwards), pipeline.py (the layer-by-layer run: GPTQ or RTN per linear), writer.py (shards,
side files, the staging folder renamed into place at the end).
"""
