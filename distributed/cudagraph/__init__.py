"""peerline.distributed.cudagraph"""
