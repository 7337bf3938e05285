"""InferenceData: column name -> numpy array, one row per element (the records route's rows)."""

from __future__ import annotations

import numpy as np

InferenceData = dict[str, np.ndarray]
