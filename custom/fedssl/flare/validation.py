"""Constructor-argument checks shared by every FLARE component: one message naming argument, value and fix."""

from __future__ import annotations


def require(ok: bool, component: str, arg: str, value: object, fix: str) -> None:
    if not ok:
        raise ValueError(f"{component}: argument {arg}={value!r} is invalid; {fix}")


def require_choice(component: str, arg: str, value: object, choices: tuple) -> None:
    require(value in choices, component, arg, value, f"use one of {list(choices)}")


def require_int(component: str, arg: str, value: object, minimum: int, fix: str) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, component, arg, value, fix)


def require_unet_args(component: str, features: object, image_size: object) -> None:
    """The U-Net arguments every ACDC executor shares: 6 channel counts and a size the 4 poolings divide."""
    from fedssl.models.unet import check_features

    try:
        check_features(features)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{component}: {e}") from None
    require(isinstance(image_size, int) and image_size >= 16 and image_size % 16 == 0, component, "image_size",
            image_size, "use a multiple of 16 (the U-Net pools 4 times), paper: 192")
