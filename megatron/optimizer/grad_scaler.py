"""fp16 loss scalers with Megatron's update rule; the scale is a host float (a power of two)."""

from __future__ import annotations

from typing import Any, Dict, Union


class ConstantGradScaler:
    """A fixed loss scale (`--loss-scale`); steps with inf/nan gradients are still skipped."""

    def __init__(self, scale: float) -> None:
        if scale <= 0.0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        """1 / scale, the factor that unscales gradients."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """A constant scale never changes."""

    def state_dict(self) -> Dict[str, Any]:
        """Nothing to save: the scale comes from the flags."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Nothing to restore."""


class DynamicGradScaler:
    """Megatron's dynamic loss scale.

    An overflow resets the growth count and uses up one unit of hysteresis; once the
    hysteresis is spent, every further overflow multiplies the scale by `backoff_factor`
    (never below `min_scale`). After `growth_interval` consecutive clean steps the scale is
    multiplied by `growth_factor` and the hysteresis is refilled.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"need 0 < --min-loss-scale ({min_scale}) <= --initial-loss-scale ({initial_scale})"
            )
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} "
                f"and {backoff_factor}"
            )
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError(
                f"--loss-scale-window ({growth_interval}) and --hysteresis ({hysteresis}) "
                "must be positive"
            )
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def inv_scale(self) -> float:
        """1 / scale, the factor that unscales gradients."""
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step whose gradients did (or did not) overflow."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's keys: scale, growth_tracker, hysteresis_tracker."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the scale and trackers; a one-element tensor scale (Megatron's) is accepted."""
        self.scale = _as_float(state_dict["scale"])
        self.growth_tracker = int(state_dict["growth_tracker"])
        self.hysteresis_tracker = int(state_dict["hysteresis_tracker"])


GradScaler = Union[ConstantGradScaler, DynamicGradScaler]


def _as_float(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)
