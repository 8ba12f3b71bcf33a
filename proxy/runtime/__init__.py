"""What a process of mmgate sets up around its event loop: the loop itself, the stop signals, the allocators and
idle trimming, the descriptor limit."""
