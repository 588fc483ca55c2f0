"""The types of the compiled loops (``_sharing.c``, a C extension mypy cannot read): every buffer is a
contiguous array, float64 or int64 as the Python callers make them, and the ``out_*`` ones are written."""
import numpy as np

def run(took: np.ndarray, asked: np.ndarray, first_wait: np.ndarray, second_wait: np.ndarray, copy: np.ndarray,
        first: np.ndarray, second: np.ndarray, stage: np.ndarray, kind: np.ndarray, queues: np.ndarray,
        device: np.ndarray, devices: int, lanes_at: np.ndarray, lane_list: np.ndarray, gap: float, forward: int,
        backward: int, input_grad: int, out_action: np.ndarray, out_start: np.ndarray, out_end: np.ndarray,
        out_copy: np.ndarray, /) -> int: ...
def times(after: np.ndarray, first: np.ndarray, second: np.ndarray, seconds: np.ndarray, after_wait: np.ndarray,
          first_wait: np.ndarray, second_wait: np.ndarray, start: np.ndarray, end: np.ndarray, /) -> None: ...
def levels(after: np.ndarray, first: np.ndarray, second: np.ndarray, level: np.ndarray, /) -> int: ...
