"""peerline.distributed.grad_sync"""
