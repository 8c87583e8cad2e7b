"""What people look at: the live monitor and the HTML report."""
