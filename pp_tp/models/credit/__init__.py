"""A small CREDIT-style weather model (declared TP on 1x1 convs) and its layout (registered on import)."""

from pp_tp.layout import register_layout
from pp_tp.models.credit.layout import CREDIT
from pp_tp.models.credit.model import CreditArgs, CreditModel

register_layout(CREDIT)

__all__ = ["CREDIT", "CreditArgs", "CreditModel"]
