"""Tasks and datasets: examples, prompt formats, rewards and evaluation rules."""

from nemo_jq.data.base import Example, Splits, Task
from nemo_jq.data.synthetic import SyntheticArithmetic

__all__ = ["Example", "Splits", "SyntheticArithmetic", "Task"]
