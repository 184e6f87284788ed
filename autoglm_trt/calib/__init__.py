"""INT8 calibration: streamed activation histograms, threshold search, SmoothQuant, Q/DQ graph."""
