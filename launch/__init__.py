"""peerline.launch"""
