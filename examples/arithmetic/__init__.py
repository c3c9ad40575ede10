"""The arithmetic recipe's walk-through scripts (its builder lives in rlstream.recipes.arithmetic)."""
