"""The request body: JSON spans and skeletons, each API's dialect, and the plan of its media parts."""
