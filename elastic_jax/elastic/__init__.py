"""What makes the model nested: the axis table, budget masks, counting, importance, nesting,
slicing and the budget router."""
