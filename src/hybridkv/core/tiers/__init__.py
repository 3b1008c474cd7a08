from hybridkv.core.tiers.base import Tier, TierStats
from hybridkv.core.tiers.memory import MemoryTier

__all__ = ["MemoryTier", "Tier", "TierStats"]
