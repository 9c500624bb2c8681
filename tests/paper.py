"""The ZeRO paper's printed tables (tests/data/zero_paper_tables.json), shared by the planner tests.

Source: Rajbhandari, Rasley, Ruwase, He. ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models. arXiv:1910.02054v3 (SC20), Table 1 and section 7.
"""

import json
from decimal import Decimal
from pathlib import Path

TABLES = json.loads((Path(__file__).parent / "data" / "zero_paper_tables.json").read_text())
STAGE_OF = {"baseline DP": 0, "Pos": 1, "Pos+g": 2, "Pos+g+p": 3}


def last_digit_unit(printed: float) -> float:
    """One unit in the last printed digit: 31.4 -> 0.1, 4187 -> 1, 0.12 -> 0.01.

    The paper rounds 7.5B cells and truncates 128B/1T cells (4187.5 is printed 4187), so an exact value
    lies within one unit of the last printed digit either way.
    """
    exponent = Decimal(repr(printed)).normalize().as_tuple().exponent
    return float(Decimal(1).scaleb(min(exponent, 0)))
