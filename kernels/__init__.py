"""peerline.kernels"""
